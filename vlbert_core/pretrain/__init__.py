"""VL-BERT pre-training: masking, the CC / text-corpus streams and their 1:1 mix, the Table 4 settings, the loop."""

from .loop import pretrain
from .settings import SETTINGS, PretrainSetting, get_setting

__all__ = ["SETTINGS", "PretrainSetting", "get_setting", "pretrain"]
