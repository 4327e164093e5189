"""The run context: the config values that jobs of every stage share (seed, device, pixel cap), typed once.

The rules pass them as params through one helper (`run_params` in workflow/rules/common.smk), each rule the
ones its job depends on; a script builds `RunContext.from_params(smk.params, require=...)` once and passes the
fields on. The pre-training launcher writes them into launch_config.yaml and every process reads them back
through the same constructor, strictly: a missing key is an error naming the file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

DEVICES = ("cpu", "cuda")  # config/schema.yaml: device


@dataclass(frozen=True)
class RunContext:
    """seed: the config's `seed` (a seeded copy of a rule: the seed of its path); device: cpu or cuda;
    max_image_pixels: the cap on an image's width x height (vlbert_core/images.py). A field a job does not
    depend on is None (its rule does not pass it, so a change of it re-runs nothing)."""

    seed: int | None = None
    device: str | None = None
    max_image_pixels: int | None = None

    def __post_init__(self) -> None:
        for name, value in self.as_dict().items():
            _check(name, value, "RunContext")

    @classmethod
    def from_params(cls, params: Any, *, require: Iterable[str] = ("seed", "device", "max_image_pixels"),
                    source: str = "the job's params") -> "RunContext":
        """The run context of a job's params (a Snakemake Params list or any mapping, a loaded YAML file, or
        a namespace with attributes): every key of `require` must be there, each present field must have its
        type; other keys are ignored. `source` names where the params came from in the errors."""
        items = dict(params.items()) if hasattr(params, "items") else dict(vars(params))
        require = tuple(require)
        unknown = [name for name in require if name not in FIELDS]
        if unknown:
            raise ValueError(f"RunContext has no field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
        missing = [name for name in require if name not in items]
        if missing:
            raise KeyError(f"{source}: no {missing[0]!r} (a run context needs {', '.join(require)})")
        values = {name: items[name] for name in FIELDS if name in items}
        for name, value in values.items():
            _check(name, value, source)
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set, e.g. for a YAML file `from_params` reads back."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


FIELDS = tuple(f.name for f in fields(RunContext))


def _check(name: str, value: Any, source: str) -> None:
    """A field's value has its type (None: not set); the error names the key and where it came from."""
    if value is None:
        return
    if name in ("seed", "max_image_pixels"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{source}: {name!r} must be an integer, not {type(value).__name__} {value!r}")
        if name == "max_image_pixels" and value < 1:
            raise ValueError(f"{source}: 'max_image_pixels' must be at least 1, not {value}")
    elif name == "device":
        if not isinstance(value, str):
            raise TypeError(f"{source}: 'device' must be a string ({', '.join(DEVICES)}), not {type(value).__name__}")
        if value not in DEVICES:
            raise ValueError(f"{source}: 'device' must be one of {', '.join(DEVICES)}, not {value!r}")

