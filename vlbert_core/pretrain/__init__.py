"""VL-BERT pre-training: masking, the CC / text-corpus streams and their 1:1 mix, the Table 4 settings, the loop."""

from .settings import SETTINGS, PretrainSetting, get_setting

__all__ = ["SETTINGS", "PretrainSetting", "get_setting", "pretrain"]


def __getattr__(name: str):
    # The loop pulls in torch and torchvision (seconds to import); the settings table is also read by
    # vlbert_core.tables, which must stay light, so the loop is imported only when asked for.
    if name == "pretrain":
        from .loop import pretrain

        return pretrain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
