"""Key accounting for checkpoint conversion: every source tensor is mapped or dropped for a stated
reason, every target tensor is produced, every shape is checked.

A converter is a list of `Rule`s (source-key regex -> target-key template, with an optional tensor
transform) and a list of `Drop`s (source-key regex + why it is not needed). `convert_state_dict`
applies them to a source state dict and checks the result against the target model's own state
dict shapes, so that a misrouted or mis-shaped tensor fails at conversion time, naming the key,
instead of at load time or never.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch


# written beside every converter's output: what happened to every tensor of the source
REPORT_FILE = "conversion_report.json"


class ConversionError(ValueError):
    """A source checkpoint does not match what a converter expects; the message names the key(s)."""


@dataclass(frozen=True)
class Rule:
    """Source keys matching `pattern` (a full-match regex) become `target` (a `re` replacement
    template, e.g. r"vlbert.encoder.layer.\\1.attention.q.weight"), passed through `transform`."""
    pattern: str
    target: str
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Drop:
    """Source keys matching `pattern` are deliberately not converted, for `reason`."""
    pattern: str
    reason: str


@dataclass
class ConversionReport:
    """What happened to each source key: `mapped` source -> target, `dropped` source -> reason,
    and target keys filled from elsewhere (`filled`: target -> why, e.g. kept at initial values)."""
    source: str
    mapped: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    filled: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"source": self.source, "num_mapped": len(self.mapped), "num_dropped": len(self.dropped),
                "num_filled": len(self.filled), "mapped": self.mapped, "dropped": self.dropped,
                "filled": self.filled}

    def write(self, path: str | Path) -> None:
        from ..utils import atomic_path

        with atomic_path(Path(path)) as tmp:
            Path(tmp).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")


def convert_state_dict(source: Mapping[str, torch.Tensor], rules: list[Rule], drops: list[Drop],
                       target_shapes: Mapping[str, tuple[int, ...]], *, source_name: str,
                       fill: Mapping[str, str] | None = None) -> tuple[dict[str, torch.Tensor], ConversionReport]:
    """Apply `rules`/`drops` to `source`; the result has exactly the keys of `target_shapes`.

    `fill`: target keys the source does not provide, with the reason (the caller fills them, e.g.
    from a freshly initialised model); any other target key left unproduced is an error. Every source
    key must match exactly one rule or drop; shapes must equal the target's.
    """
    report = ConversionReport(source=source_name)
    compiled = [(re.compile(r.pattern), r) for r in rules]
    compiled_drops = [(re.compile(d.pattern), d) for d in drops]
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, tensor in source.items():
        hits = [(m, r) for rx, r in compiled if (m := rx.fullmatch(key))]
        drop_hits = [d for rx, d in compiled_drops if rx.fullmatch(key)]
        if len(hits) + len(drop_hits) > 1:
            raise ConversionError(f"{source_name}: key {key!r} matches more than one rule or drop: "
                                  f"{[r.pattern for _, r in hits] + [d.pattern for d in drop_hits]}")
        if drop_hits:
            report.dropped[key] = drop_hits[0].reason
            continue
        if not hits:
            unknown.append(key)
            continue
        match, rule = hits[0]
        target_key = match.expand(rule.target)
        if target_key not in target_shapes:
            raise ConversionError(f"{source_name}: key {key!r} maps to {target_key!r}, which the target model "
                                  "does not have")
        if target_key in out:
            raise ConversionError(f"{source_name}: two source keys map to {target_key!r} "
                                  f"(second: {key!r})")
        value = rule.transform(tensor) if rule.transform else tensor
        expected = tuple(target_shapes[target_key])
        if tuple(value.shape) != expected:
            raise ConversionError(f"{source_name}: key {key!r} -> {target_key!r} has shape {tuple(value.shape)}, "
                                  f"the target expects {expected}")
        out[target_key] = value.detach().clone().contiguous()
        report.mapped[key] = target_key
    if unknown:
        shown = ", ".join(repr(k) for k in sorted(unknown)[:10])
        raise ConversionError(f"{source_name}: {len(unknown)} key(s) no rule knows: {shown}"
                              + (" ..." if len(unknown) > 10 else ""))
    fill = dict(fill or {})
    missing = sorted(k for k in target_shapes if k not in out and k not in fill)
    if missing:
        shown = ", ".join(repr(k) for k in missing[:10])
        raise ConversionError(f"{source_name}: {len(missing)} target key(s) missing from the source: {shown}"
                              + (" ..." if len(missing) > 10 else ""))
    report.filled = {k: v for k, v in sorted(fill.items()) if k not in out}
    return out, report


def strip_module_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DataParallel / DDP keys start with 'module.'; a checkpoint saved without the wrapper has none."""
    if all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return dict(state)


def check_aliases(source: dict[str, torch.Tensor], aliases: list[tuple[str, str]], source_name: str) -> None:
    for pattern, template in aliases:
        rx = re.compile(pattern)
        for key, value in source.items():
            match = rx.fullmatch(key)
            if not match:
                continue
            original = match.expand(template)
            if original not in source:
                raise ConversionError(f"{source_name}: {key!r} should repeat {original!r}, which is missing")
            if value.shape != source[original].shape:
                raise ConversionError(f"{source_name}: {key!r} has shape {tuple(value.shape)}, {original!r} "
                                      f"{tuple(source[original].shape)}; they should be one tensor")
            # a shape-only dry run (tensors on the meta device) has no values to compare
            if not value.is_meta and not torch.equal(value, source[original]):
                raise ConversionError(f"{source_name}: {key!r} differs from {original!r}; the released model "
                                      "registers one tensor under both names, so they must be equal")
