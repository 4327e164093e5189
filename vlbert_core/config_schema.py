"""The one check of a config against config/schema.yaml, for every reader of a config (issue #56): the workflow
(Snakefile), `python -m vlbert_core.predict --config` and `python -m vlbert_core.pretrain --config`.

Files are read with `vlbert_core.utils.read_yaml`, which refuses a key given twice. A config that does not fit the
schema fails in one line naming the file and the key (`ConfigError`), never with the schema printed:
- a key the schema does not know (a typo: `finetune.vqa.lrr`, `pretrain.stepz`) names the key, its section's
  closest known key, and how many it takes;
- a value of the wrong type or range names the key and what the schema says of it.

The workflow validates the merged config in full (`check_workflow_config`, `required` keys included) and then lets
Snakemake's own `validate` fill the schema's defaults, as before. A command line's --config files may hold a part
of a config only (a task of your own, one override), so each file and their merge are validated with the
schema's `required` lists left out (`read_configs`); what the command reads it checks itself (RunContext, the
loops' own keys).

Where the schema is: config/schema.yaml of the repository, the one copy (the Snakefile reads it there too). The
CLIs find it relative to the package (`Path(vlbert_core.__file__).parents[1] / "config"`), which is where it is in
a checkout and in the editable install `uv sync` makes. A wheel does not carry config/: `vlbert_core/schema.yaml`
inside the package is looked for first, so that a wheel that packs the same file there (hatch's `force-include`
of config/schema.yaml as vlbert_core/schema.yaml) validates too; without either, the CLIs fail naming both paths.
"""

from __future__ import annotations

import difflib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import vlbert_core

PACKAGED_SCHEMA = Path(vlbert_core.__file__).resolve().parent / "schema.yaml"   # in a wheel (force-include)
REPO_SCHEMA = Path(vlbert_core.__file__).resolve().parents[1] / "config" / "schema.yaml"   # in a checkout
_MESSAGE_CHARS = 160   # a value's description is cut here: the error stays one readable line


class ConfigError(ValueError):
    """A config that does not fit config/schema.yaml, or a file that gives a key twice; the message names both."""


def schema_path() -> Path:
    """config/schema.yaml: the packaged copy of a wheel, else the checkout's."""
    for path in (PACKAGED_SCHEMA, REPO_SCHEMA):
        if path.is_file():
            return path
    raise FileNotFoundError(f"config/schema.yaml not found: neither {PACKAGED_SCHEMA} (an installed wheel) nor "
                            f"{REPO_SCHEMA} (a checkout) exists")


@lru_cache(maxsize=4)
def _validator(path: str, partial: bool):
    from jsonschema import Draft202012Validator, validators

    from vlbert_core.utils import read_yaml

    schema = read_yaml(path, "schema")
    cls = Draft202012Validator
    if partial:   # a part of a config: the keys it has must fit, the keys it lacks are someone else's
        cls = validators.extend(cls, {"required": lambda validator, required, instance, schema: iter(())})
    return cls(schema)


def _dotted(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _known_keys(schema: Mapping[str, Any]) -> list[str]:
    return sorted(schema.get("properties", {}))


def describe(error) -> str:
    """One line of a jsonschema ValidationError: the key and what is wrong with it."""
    where = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        known = _known_keys(error.schema)
        extra = [key for key in error.instance if key not in known]
        patterns = error.schema.get("patternProperties") or {}
        if extra and not patterns:
            key = extra[0]
            close = difflib.get_close_matches(str(key), known, n=1)
            section = _dotted(where) or "the top level"
            hint = f"did you mean {_dotted([*where, close[0]])}? " if close else ""
            return (f"key {_dotted([*where, key])} is not in config/schema.yaml ({hint}{section} takes "
                    f"{len(known)} keys: {', '.join(known[:12])}{', ...' if len(known) > 12 else ''})")
    message = " ".join(error.message.split())
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + "..."
    return f"key {_dotted(where)}: {message}" if where else message


def validate_config(config: Mapping[str, Any], source: str, *, partial: bool) -> None:
    """ConfigError naming `source` and the key when `config` does not fit the schema (`partial`: its `required`
    lists left out). Nothing is filled in."""
    from jsonschema.exceptions import best_match

    error = best_match(_validator(str(schema_path()), partial).iter_errors(dict(config)))
    if error is not None:
        raise ConfigError(f"{source}: {describe(error)}")


def read_configs(paths: Sequence[str | os.PathLike], what: str = "--config") -> dict:
    """The --config files of a command line, each read (a key given twice is an error), validated against the
    schema (partial) and merged in order, later ones winning key by key as Snakemake's --configfile; the merge is
    validated too. A missing path, or one that is a directory, is an error naming it."""
    from vlbert_core.utils import read_yaml

    config: dict = {}
    for path in map(Path, paths):
        check_input_file(path, what)
        part = read_yaml(path, what)
        validate_config(part, f"{what} {path}", partial=True)
        config = merge(config, part)
    if len(paths) > 1:
        validate_config(config, f"the merged {what} files {[str(p) for p in paths]}", partial=True)
    return config


def check_workflow_config(config: Mapping[str, Any], files: Iterable[str | os.PathLike]) -> None:
    """The Snakefile's check, before Snakemake's `validate` fills the defaults: each config file read with the
    one reader (a key given twice is an error), then the merged config validated in full; one line, no schema."""
    from vlbert_core.utils import read_yaml

    for path in dict.fromkeys(map(str, files)):
        validate_config(read_yaml(path, "configfile"), f"configfile {path}", partial=True)
    validate_config(config, "the merged config (config/config.yaml and the --configfile files)", partial=False)


def merge(base: dict, override: Mapping[str, Any]) -> dict:
    """Nested dicts merged key by key (override wins), as Snakemake merges --configfile over configfile."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def check_input_file(path: str | os.PathLike, what: str) -> Path:
    """`path` as a Path when it is a file; else an error saying what it is instead (missing, a directory)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a directory, not a file")
    if not path.is_file():
        raise ValueError(f"{what} {path} is not a regular file")
    return path


def check_input_dir(path: str | os.PathLike, what: str) -> Path:
    """`path` as a Path when it is a directory; else an error saying what it is instead (missing, a file)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{what} {path} is a file, not a directory")
    return path
