"""The run context (vlbert_core/run_context.py): the seed, device and pixel cap a job's params carry, typed once, and
read back strictly from the pre-training launcher's launch_config.yaml."""

from __future__ import annotations

import pytest
import yaml

from vlbert_core.run_context import FIELDS, RunContext

PARAMS = {"seed": 3, "device": "cpu", "max_image_pixels": 1000, "code": "0123abcd", "setting": "b"}


def test_a_job_s_params_give_the_run_context_and_other_keys_are_left_alone():
    run = RunContext.from_params(PARAMS)
    assert run == RunContext(seed=3, device="cpu", max_image_pixels=1000)
    assert run.as_dict() == {"seed": 3, "device": "cpu", "max_image_pixels": 1000}
    assert FIELDS == ("seed", "device", "max_image_pixels")
    with pytest.raises(AttributeError):
        run.seed = 4  # frozen


def test_a_job_needs_only_the_fields_its_rule_passes():
    run = RunContext.from_params({"max_image_pixels": 5}, require=("max_image_pixels",))
    assert (run.seed, run.device, run.max_image_pixels) == (None, None, 5)
    assert run.as_dict() == {"max_image_pixels": 5}


def test_snakemake_params_are_read_by_name():
    from snakemake.iocontainers import Params

    params = Params(fromdict=PARAMS)
    assert RunContext.from_params(params, require=("device", "max_image_pixels")) == RunContext(3, "cpu", 1000)
    # the tests' stand-in `snakemake` objects give their params as a namespace
    from types import SimpleNamespace

    assert RunContext.from_params(SimpleNamespace(**PARAMS)) == RunContext(3, "cpu", 1000)


@pytest.mark.parametrize("missing", FIELDS)
def test_a_missing_key_is_named_with_where_it_was_looked_for(missing):
    params = {k: v for k, v in PARAMS.items() if k != missing}
    with pytest.raises(KeyError, match=f"launch_config.yaml: no '{missing}'"):
        RunContext.from_params(params, source="launch_config.yaml")


@pytest.mark.parametrize("key, value, error", [
    ("seed", "3", TypeError), ("seed", 3.0, TypeError), ("seed", True, TypeError),
    ("max_image_pixels", "89478485", TypeError), ("max_image_pixels", 0, ValueError),
    ("device", 0, TypeError), ("device", "gpu", ValueError),
])
def test_a_wrong_type_or_value_names_the_key(key, value, error):
    with pytest.raises(error, match=f"the job's params: '{key}'"):
        RunContext.from_params({**PARAMS, key: value})
    with pytest.raises(error, match=f"'{key}'"):
        RunContext(**{key: value})


def test_an_unknown_field_asked_for_is_an_error():
    with pytest.raises(ValueError, match="no field 'seeds'"):
        RunContext.from_params(PARAMS, require=("seeds",))


def test_the_pretraining_command_reads_the_run_context_strictly(tmp_path, capsys):
    """launch_config.yaml without max_image_pixels (or a device) fails naming the file, before anything runs."""
    from vlbert_core.cli import run_command
    from vlbert_core.pretrain.__main__ import main

    common = ["--setting", "a", "--cc-shards", "a.tar", "--roi-parquets", "a.parquet", "--detector", "d.pt",
              "--out", str(tmp_path / "out")]
    config_file = tmp_path / "launch_config.yaml"
    config_file.write_text(yaml.safe_dump({"model": {}, "pretrain": {}, "seed": 0, "device": "cpu"}))
    assert run_command(main, "python -m vlbert_core.pretrain", [*common, "--config", str(config_file)]) == 1
    err = capsys.readouterr().err
    assert str(config_file) in err and "'max_image_pixels'" in err, err
    config_file.write_text(yaml.safe_dump({"model": {}, "pretrain": {}, "seed": 0, "max_image_pixels": 10}))
    assert run_command(main, "python -m vlbert_core.pretrain", [*common, "--config", str(config_file)]) == 1
    assert "'device'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
