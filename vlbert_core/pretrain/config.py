"""The config's `pretrain:` section, typed once (PretrainSettings); the Table 4 settings are settings.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from vlbert_core.typed_settings import read_fields, source_field

from .launch import DEFAULT_COLLECTIVE_TIMEOUT_S

# keys the fingerprint of a run leaves out: the list of settings to run, and how long a rank waits for the others
NOT_FINGERPRINTED = ("settings", "collective_timeout_s")


@dataclass(frozen=True)
class PretrainSettings:
    """One pre-training job's hyper-parameters (config/schema.yaml `pretrain:`). `section` is the section as
    given: the checkpoint fingerprint hashes it as written (to_fingerprint), so old checkpoints still resume."""

    steps: int
    cc_batch_size: int
    text_batch_size: int
    lr_per_sample: float
    weight_decay: float
    warmup_steps: int
    clip_grad: float
    max_text_len: int
    max_caption_len: int
    checkpoint_every: int
    streams_per_rank: int
    stream_workers: bool
    held_out_per_shard: int
    visual_lr_scale: float = 1.0
    collective_timeout_s: float = float(DEFAULT_COLLECTIVE_TIMEOUT_S)
    section: dict = source_field(default_factory=dict)

    @classmethod
    def from_config(cls, mapping: Mapping[str, Any], where: str = "pretrain") -> "PretrainSettings":
        return cls(**read_fields(cls, mapping, where), section=dict(mapping))

    @classmethod
    def of(cls, value: "PretrainSettings | Mapping[str, Any]", where: str = "pretrain") -> "PretrainSettings":
        """`value` itself, or the settings of a `pretrain:` mapping (hand-written calls, tests)."""
        return value if isinstance(value, cls) else cls.from_config(value, where)

    def check_schedule(self) -> None:
        if self.steps < 1 or self.warmup_steps < 0 or self.checkpoint_every < 1:
            raise ValueError(f"pretrain: steps ({self.steps}) and checkpoint_every must be >= 1, warmup_steps >= 0")

    def to_fingerprint(self) -> dict:
        return {k: v for k, v in self.section.items() if k not in NOT_FINGERPRINTED}
