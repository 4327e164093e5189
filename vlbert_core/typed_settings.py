"""Typed settings at the boundary: a job's config section read once into a frozen dataclass.

A settings class lists its keys as dataclass fields, each annotated with one of the kinds below; `read_fields`
fills them from the (schema-validated) mapping, checking each value's type and naming the key and where it came
from when it is missing or of the wrong type. A field without a default is required. Fields marked
`source_field()` are not read from the mapping (the class fills them itself, e.g. the mapping as given, for the
resume fingerprints, which hash the config exactly as written).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

NOT_A_KEY = "not_a_key"


def source_field(**kwargs: Any) -> Any:
    """A field that is not a config key (compare/repr off)."""
    return dataclasses.field(compare=False, repr=False, metadata={NOT_A_KEY: True}, **kwargs)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(kind: str, value: Any, key: str, where: str) -> Any:
    """`value` of config key `where.key` as the kind says; TypeError naming the key otherwise."""
    if kind.endswith(" | None"):
        return None if value is None else check_value(kind[: -len(" | None")], value, key, where)
    ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": _number,
          "bool": lambda v: isinstance(v, bool),
          "str": lambda v: isinstance(v, str),
          "tuple[float, ...]": lambda v: isinstance(v, (list, tuple)) and all(map(_number, v)),
          "tuple[str, ...]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
          "tuple[int, ...]": lambda v: (isinstance(v, (list, tuple))
                                        and all(isinstance(n, int) and not isinstance(n, bool) for n in v)),
          "tuple[int, int]": lambda v: (isinstance(v, (list, tuple)) and len(v) == 2
                                        and all(isinstance(n, int) and not isinstance(n, bool) for n in v)),
          "dict": lambda v: isinstance(v, Mapping)}.get(kind)
    if ok is None:
        raise TypeError(f"typed settings: unknown kind {kind!r} of {where}.{key}")
    if not ok(value):
        raise TypeError(f"config {where}.{key} must be {_NAMES[kind]}, not {type(value).__name__} {value!r}")
    if kind == "float":
        return float(value)
    if kind == "tuple[float, ...]":
        return tuple(float(v) for v in value)
    if kind in ("tuple[int, int]", "tuple[int, ...]", "tuple[str, ...]"):
        return tuple(value)
    if kind == "dict":
        return dict(value)
    return value


_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
          "tuple[float, ...]": "a list of numbers", "tuple[int, int]": "a list of two integers",
          "tuple[int, ...]": "a list of integers", "tuple[str, ...]": "a list of strings",
          "dict": "a mapping"}


def read_fields(cls: type, mapping: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keyword arguments of settings class `cls` from config section `where` (e.g. "pretrain",
    "finetune.vqa"): every required field present (KeyError listing the missing ones), every value of its
    kind (TypeError naming the key). Keys of the mapping that are no field are left to the caller."""
    if not isinstance(mapping, Mapping):
        raise TypeError(f"config section '{where}' must be a mapping, not {type(mapping).__name__}")
    keys = [f for f in dataclasses.fields(cls) if not f.metadata.get(NOT_A_KEY)]
    missing = [f.name for f in keys if f.name not in mapping
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise KeyError(f"config section '{where}' lacks keys {missing}")
    return {f.name: check_value(str(f.type), mapping[f.name], f.name, where) for f in keys if f.name in mapping}
