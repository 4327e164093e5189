"""Config fuzzing: a few hundred mutations of config/config.yaml (wrong types, negative and zero sizes,
out-of-range fractions, unknown keys, missing keys, nulls). Each one is either rejected before any
job runs, with the offending key named, or is valid and plans the whole Table 4 DAG.

The mutated config is what a user would pass with `--configfile` (merged over config.yaml); missing
keys cannot be expressed that way, so deletions are checked against the schema directly (the
Snakefile validates the merged config with the same schema before anything else).
Planning runs in two subprocesses through Snakemake's API (about 1 s a plan instead of 5 s a process). Every
mutation the schema accepts is planned; of those it rejects (the Snakefile's first act is the same `validate`
with the same schema, so the error is the one checked here directly), a seeded sample of
REJECTED_PLANS_SAMPLED goes through the workflow too, to show that it stops there before any job.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[2]
SCHEMA = str(REPO / "config" / "schema.yaml")
NUM_MUTATIONS = 240
SEED = 20261125
PLANNER_PROCESSES = 2  # the CI machine's cores
REJECTED_PLANS_SAMPLED = 30   # of the ~150 mutations the schema rejects: each plan is ~1 s of the suite

PLANNER = r'''
import json, sys, traceback
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings, StorageSettings

repo, workdir, cases = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
results = []
for case in cases:
    try:
        with SnakemakeApi(OutputSettings(quiet={"all"})) as api:
            workflow = api.workflow(snakefile=repo / "Snakefile", workdir=workdir,
                                    config_settings=ConfigSettings(configfiles=[Path(case["file"])]),
                                    resource_settings=ResourceSettings(cores=1), storage_settings=StorageSettings())
            workflow.dag(DAGSettings(targets={"results/tables/table4_ablation.csv"})).execute_workflow(executor="dryrun")
        results.append({"ok": True})
    except BaseException as e:
        text = "".join(traceback.format_exception(e))
        # the head says what was wrong (a schema error names the key first, then dumps the whole config), the tail
        # where it was raised
        results.append({"ok": False, "error": text if len(text) <= 8000 else text[:4000] + " [...] " + text[-4000:]})
print(json.dumps(results))
'''


def leaves(node, path=()):
    """(path, value) of every scalar or list in the config tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, path + (key,))
    else:
        yield path, node


def dicts(node, path=()):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from dicts(value, path + (key,))


def get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def override_for(path, value):
    """The smallest --configfile that sets `path` to `value`."""
    node = value
    for key in reversed(path):
        node = {key: node}
    return node


def mutations(config: dict, rng: random.Random, count: int) -> list[dict]:
    """Each mutation: {kind, path (the key that must be named if rejected), override | deleted}."""
    all_leaves = [(p, v) for p, v in leaves(config)]
    all_dicts = [(p, d) for p, d in dicts(config) if d]
    out = []
    while len(out) < count:
        kind = rng.choice(["wrong_type", "negative", "zero", "out_of_range", "unknown_key", "missing_key", "null",
                           "list_junk"])
        if kind == "unknown_key":
            path, _ = rng.choice(all_dicts)
            name = f"unknown_key_{rng.randrange(1000)}"
            out.append({"kind": kind, "path": list(path) + [name], "override": override_for(path + (name,), 1)})
            continue
        path, value = rng.choice(all_leaves)
        if kind == "missing_key":
            # delete the leaf, or its whole section
            cut = path[:rng.randrange(1, len(path) + 1)]
            out.append({"kind": kind, "path": list(cut), "deleted": True})
            continue
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind == "wrong_type":
            new = {str: 7, bool: "yes", int: "many", float: "a lot", list: "x", type(None): [1]}.get(type(value), 3)
        elif kind == "negative":
            if not numeric:
                continue
            new = -abs(value) - 1 if isinstance(value, int) else -abs(value) - 0.5
        elif kind == "zero":
            if not numeric:
                continue
            new = 0 if isinstance(value, int) else 0.0
        elif kind == "out_of_range":
            if not numeric:
                continue
            new = 1.5 if isinstance(value, float) and 0 <= value <= 1 else 10**12
        elif kind == "null":
            new = None
        else:  # list_junk
            if not isinstance(value, list):
                continue
            new = value + [{"junk": True}]
        out.append({"kind": kind, "path": list(path), "override": override_for(path, new)})
    return out


def merged(base: dict, override: dict) -> dict:
    result = copy.deepcopy(base)

    def merge(into, extra):
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value
    merge(result, override)
    return result


def names_key(message: str, path: list) -> bool:
    """The error points at the mutated key: by its name, or by the nearest named key of its path
    (a list element or a whole section has no name of its own)."""
    return any(str(key) in message for key in reversed(path))


def test_config_mutations_are_rejected_naming_the_key_or_plan(tmp_path):
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cases = mutations(base, random.Random(SEED), NUM_MUTATIONS)
    kinds = {c["kind"] for c in cases}
    assert kinds >= {"wrong_type", "negative", "zero", "out_of_range", "unknown_key", "missing_key", "null"}

    failures, to_plan = [], []
    for i, case in enumerate(cases):
        if case.get("deleted"):
            config = copy.deepcopy(base)
            parent = get(config, case["path"][:-1])
            del parent[case["path"][-1]]
            try:
                validate(config, SCHEMA)   # filled from the schema's defaults, or rejected
            except Exception as e:
                if not names_key(str(e), case["path"]):
                    failures.append((case, f"rejected without naming the key: {str(e)[:300]}"))
            continue
        try:
            validate(merged(base, case["override"]), SCHEMA)
        except Exception as e:
            case["schema_error"] = str(e)
            if not names_key(case["schema_error"], case["path"]):
                failures.append((case, f"rejected without naming the key: {case['schema_error'][:300]}"))
        path = tmp_path / f"mutation-{i}.yaml"
        path.write_text(yaml.safe_dump(case["override"]))
        case["file"] = str(path)
        to_plan.append(case)
    schema_rejected = [c for c in to_plan if "schema_error" in c]
    sampled = {id(c) for c in random.Random(SEED).sample(schema_rejected,
                                                         min(REJECTED_PLANS_SAMPLED, len(schema_rejected)))}
    to_plan = [c for c in to_plan if "schema_error" not in c or id(c) in sampled]

    # The plans in PLANNER_PROCESSES processes at once, each with its own share of the cases and working directory.
    planners = []
    for k in range(PLANNER_PROCESSES):
        workdir = tmp_path / f"work{k}"
        workdir.mkdir()
        cases_file = tmp_path / f"cases{k}.json"
        cases_file.write_text(json.dumps([{"file": c["file"]} for c in to_plan[k::PLANNER_PROCESSES]]))
        planners.append((workdir, subprocess.Popen([sys.executable, "-c", PLANNER, str(REPO), str(workdir),
                                                    str(cases_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                   text=True)))
    shares = []
    for workdir, planner in planners:
        stdout, stderr = planner.communicate(timeout=900)
        assert planner.returncode == 0, stderr[-3000:]
        shares.append(json.loads(stdout.strip().splitlines()[-1]))
    results = [None] * len(to_plan)
    for k, share in enumerate(shares):
        results[k::PLANNER_PROCESSES] = share
    assert None not in results
    rejected = planned = 0
    for case, result in zip(to_plan, results):
        if result["ok"]:
            planned += 1
            if "schema_error" in case:
                failures.append((case, "the schema rejects it but the workflow planned it"))
        else:
            rejected += 1
            if not names_key(result["error"], case["path"]):
                failures.append((case, f"rejected without naming the key: ...{result['error'][-600:]}"))
    # nothing ran: a rejected or planned config writes no job output
    for workdir, _ in planners:
        assert not (workdir / "results").exists() and not (workdir / "resources").exists()
    assert rejected and planned, (rejected, planned)
    assert not failures, "\n".join(f"{c['kind']} {c['path']} {c.get('override')}: {why}" for c, why in failures[:15])
