"""No silent wrong answer (issue #56): each case of the issue ends in a correct answer (16-bit, EXIF, animation)
or one line naming the file or key, exit status 1 (2 for arguments), no traceback, nothing half-written.

The image cases check the decoded pixels of the one decoder (vlbert_core/images.py `load_rgb`) everywhere it is
used; the model cases run `python -m vlbert_core.predict` on tiny fine-tunes of the tasks' world
(tests/tasks/test_tasks.py), as tests/predict/test_predict.py does.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from PIL import Image
from test_tasks import HPARAMS, MODEL_CFG, world  # noqa: F401  (world: the tasks' module fixture)

from vlbert_core.cli import run_command

PREDICT = "python -m vlbert_core.predict"
PRETRAIN = "python -m vlbert_core.pretrain"
CONVERT = "python -m vlbert_core.convert"


def predict_main():
    from vlbert_core.predict.__main__ import main

    return main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def argument_error(capsys, main, prog: str, args: list[str]) -> str:
    """The last stderr line of an argparse error (exit 2: usage, then `prog: error: ...`)."""
    with pytest.raises(SystemExit) as exit_:
        run_command(main, prog, args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage:"), err
    return err.strip().splitlines()[-1]


def gradient_16bit(width: int = 64, height: int = 8) -> Image.Image:
    """A 16-bit greyscale (I;16) horizontal gradient from 0 to 65535."""
    row = np.linspace(0, 65535, width).round().astype(np.uint16)
    return Image.fromarray(np.tile(row, (height, 1)))


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def exif_rotated(upright: Image.Image, fmt: str = "JPEG") -> bytes:
    """`upright` stored sideways with EXIF orientation 6 (a viewer turns it 90 degrees clockwise to show it)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(upright.transpose(Image.Transpose.ROTATE_90), fmt, exif=exif,
                  **({"quality": 95} if fmt == "JPEG" else {}))


# ---- the one decoder: modes, orientation, animation, thin images -------------------------------------------------

def test_a_16bit_greyscale_png_keeps_its_gradient_in_every_reader(tmp_path):
    from vlbert_core.data.resizer import resize_image
    from vlbert_core.detector.images import decode_image
    from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb
    from vlbert_core.tasks.common import load_task_image

    path = tmp_path / "grey16.png"
    gradient_16bit().save(path)
    with Image.open(path) as raw:
        assert raw.mode == "I;16"
        assert (np.asarray(raw.convert("RGB"))[:, 1:] == 255).all()   # Pillow's convert clips: white but for 0
    pixels = np.asarray(load_rgb(path, max_pixels=DEFAULT_MAX_PIXELS))
    assert pixels.dtype == np.uint8 and pixels.shape == (8, 64, 3)
    expected = np.linspace(0, 255, 64).round()
    assert np.abs(pixels[0, :, 0] - expected).max() <= 1      # the real range: 65535 -> 255
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()
    assert np.array_equal(decode_image(path).numpy().transpose(1, 2, 0), pixels)   # RoI extraction, detector
    task_image, scale, original = load_task_image(path, 64)                          # the task datasets, predict
    assert original == (64, 8) and scale == (1.0, 1.0) and np.array_equal(np.asarray(task_image), pixels)
    resized = resize_image(path.read_bytes(), 64)                                     # the CC resizer
    with Image.open(io.BytesIO(resized.jpeg)) as cc:
        row = np.asarray(cc.convert("L"))[4].astype(int)
    assert abs(row[0] - 0) <= 3 and abs(row[-1] - 255) <= 3 and (np.diff(row) >= -3).all()


@pytest.mark.parametrize("mode, fill, expected", [
    ("I", 65535, (255, 255, 255)),              # 16-bit samples opened as I
    ("I", 32768, (128, 128, 128)),
    ("RGBA", (0, 0, 255, 0), (255, 255, 255)),  # transparent: onto white, as the CC resizer has always done
    ("RGBA", (0, 0, 255, 255), (0, 0, 255)),
    ("LA", (0, 0), (255, 255, 255)),
    ("L", 77, (77, 77, 77)),
    ("CMYK", (0, 255, 255, 0), (255, 0, 0)),
])
def test_every_mode_becomes_8bit_rgb_the_same_way_everywhere(mode, fill, expected):
    from vlbert_core.data.resizer import resize_image
    from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb, to_rgb

    image = Image.new(mode, (8, 8), fill)
    assert to_rgb(image).getpixel((4, 4)) == expected
    fmt = "TIFF" if mode in ("I", "CMYK") else "PNG"
    data = encode(image, fmt)
    assert load_rgb(data, max_pixels=DEFAULT_MAX_PIXELS).getpixel((4, 4)) == expected
    with Image.open(io.BytesIO(resize_image(data, 16).jpeg)) as cc:
        assert all(abs(a - b) <= 6 for a, b in zip(cc.getpixel((4, 4)), expected))


def test_a_palette_image_with_a_transparent_colour_goes_onto_white():
    from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb

    image = Image.new("P", (8, 8), 0)
    image.putpalette([0, 0, 0] + [10, 200, 10] * 255)
    data = encode(image, "PNG", transparency=0)
    assert load_rgb(data, max_pixels=DEFAULT_MAX_PIXELS).getpixel((3, 3)) == (255, 255, 255)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_an_exif_rotated_image_decodes_upright(fmt, tmp_path):
    from vlbert_core.detector.images import decode_image
    from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb

    upright = Image.new("RGB", (48, 32), (0, 0, 0))
    upright.paste((255, 255, 255), (0, 0, 24, 16))   # white top-left quarter
    path = tmp_path / f"rotated.{fmt.lower()}"
    path.write_bytes(exif_rotated(upright, fmt))
    with Image.open(path) as stored:
        assert stored.size == (32, 48)
    decoded = load_rgb(path, max_pixels=DEFAULT_MAX_PIXELS)
    assert decoded.size == (48, 32)
    if fmt == "PNG":   # lossless: exactly the upright pixels
        assert np.array_equal(np.asarray(decoded), np.asarray(upright))
    assert min(decoded.getpixel((5, 5))) > 200 and max(decoded.getpixel((40, 25))) < 60
    assert tuple(decode_image(path).shape) == (3, 32, 48)


def test_an_animation_gives_its_first_frame_and_says_so(tmp_path, caplog):
    from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb

    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    caplog.set_level("INFO", logger="vlbert")
    logger = __import__("logging").getLogger("vlbert")
    logger.addHandler(caplog.handler)
    try:
        pixel = load_rgb(path, max_pixels=DEFAULT_MAX_PIXELS).getpixel((4, 4))
    finally:
        logger.removeHandler(caplog.handler)
    assert pixel[0] > 240 and pixel[1] < 20 and pixel[2] < 20
    assert any(f"image {path} has 3 frames" in r.getMessage() and "first frame" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_an_image_too_thin_to_resize_is_refused_naming_it_and_its_size(tmp_path):
    from vlbert_core.images import ImageTooThin
    from vlbert_core.tasks.common import load_task_image

    path = tmp_path / "thin.png"
    Image.new("RGB", (9000, 2)).save(path)
    with pytest.raises(ImageTooThin, match=rf"image {path} is 9000x2 pixels: .* 32 pixels, which leaves its "
                                           r"shorter side 0 pixels"):
        load_task_image(path, 32)


def test_the_world_images_decode_as_before(world):  # noqa: F811
    """Plain 8-bit RGB JPEG/PNG without EXIF: the same pixels as Pillow's convert("RGB"), which the decoder was
    before (the default run's numbers do not move)."""
    from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb

    root, _ = world
    files = sorted(p for p in root.rglob("*") if p.suffix in (".jpg", ".png"))
    assert files
    for path in files:
        with Image.open(path) as image:
            before = np.asarray(image.convert("RGB"))
        assert np.array_equal(np.asarray(load_rgb(path, max_pixels=DEFAULT_MAX_PIXELS)), before), path


# ---- config files: one reader, one schema ------------------------------------------------------------------------

def test_a_key_given_twice_is_refused_naming_the_key_the_file_and_both_lines(tmp_path):
    from vlbert_core.utils import read_yaml

    path = tmp_path / "twice.yaml"
    path.write_text("finetune:\n  vqa:\n    lr: 0.1\n  refcoco:\n    lr: 0.2\n  vqa:\n    lr: 0.3\n")
    with pytest.raises(ValueError, match=rf"config {path}: key finetune.vqa is given twice, lines 2 and 6"):
        read_yaml(path)
    path.write_text("a: {b: 1, b: 2}\n")
    with pytest.raises(ValueError, match=r"key a.b is given twice, lines 1 and 1"):
        read_yaml(path)
    path.write_text("base: &base {x: 1}\nother:\n  <<: *base\n  <<: *base\n")   # merge keys are no keys
    assert read_yaml(path)["other"] == {"x": 1}


def _pretrain_config(tmp_path, **pretrain) -> Path:
    path = tmp_path / "launch_config.yaml"
    path.write_text(json.dumps({"seed": 0, "device": "cpu", "max_image_pixels": 1000, "model": {"bert_path": "x"},
                                "pretrain": {"settings": ["a"], "steps": 1, **pretrain}}))
    return path


def _pretrain_args(tmp_path, config: Path, **override) -> list[str]:
    for name in ("a.tar", "a.parquet", "d.pt"):
        (tmp_path / name).write_bytes(b"x")
    args = {"--setting": "a", "--config": str(config), "--cc-shards": str(tmp_path / "a.tar"),
            "--roi-parquets": str(tmp_path / "a.parquet"), "--detector": str(tmp_path / "d.pt"),
            "--out": str(tmp_path / "out"), **override}
    return [item for key, value in args.items() for item in (key, value)]


def test_a_config_typo_or_a_key_given_twice_stops_predict_and_pretrain_in_one_line(tmp_path, capsys):
    from vlbert_core.pretrain.__main__ import main as pretrain_main

    typo = tmp_path / "typo.yaml"
    typo.write_text("finetune:\n  vqa:\n    lrr: 0.1\n")
    twice = tmp_path / "twice.yaml"
    twice.write_text("rois:\n  score_threshold: 0.2\nrois:\n  score_threshold: 0.5\n")
    photo = tmp_path / "photo.png"
    Image.new("RGB", (8, 8)).save(photo)
    for config, words in ((typo, "key finetune.vqa.lrr is not in config/schema.yaml (did you mean finetune.vqa.lr?"),
                          (twice, "key rois is given twice, lines 1 and 3")):
        status = run_command(predict_main(), PREDICT, ["--model", str(tmp_path / "model"), "--config", str(config),
                                                       "--image", str(photo), "--text", "a"])
        line = one_error_line(capsys)
        assert status == 1 and line.startswith(f"{PREDICT}: error: --config {config}: {words}"), line
    stepz = _pretrain_config(tmp_path, stepz=3)
    assert run_command(pretrain_main, PRETRAIN, _pretrain_args(tmp_path, stepz)) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"{PRETRAIN}: error: --config {stepz}: key pretrain.stepz is not in config/schema.yaml "
                           "(did you mean pretrain.steps? pretrain takes "), line
    bad_value = _pretrain_config(tmp_path, steps="three")
    assert run_command(pretrain_main, PRETRAIN, _pretrain_args(tmp_path, bad_value)) == 1
    assert "key pretrain.steps: 'three' is not of type 'integer'" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.workflow
def test_the_workflow_names_the_key_not_the_schema(tmp_path):
    """Snakemake's own config loading keeps the last of two keys: the Snakefile reads the configfiles again with
    the one reader, and validates with the one-line error before Snakemake's validate fills the defaults."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("finetune:\n  vqa:\n    lrr: 0.1\n")
    twice = tmp_path / "twice.yaml"
    twice.write_text("finetune:\n  vqa:\n    lr: 0.1\n  vqa:\n    lr: 0.2\n")
    for config, words in ((typo, f"configfile {typo}: key finetune.vqa.lrr is not in config/schema.yaml"),
                          (twice, f"configfile {twice}: key finetune.vqa is given twice, lines 2 and 4")):
        result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--configfile", str(config)], cwd=REPO,
                                capture_output=True, text=True, timeout=300)
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert words in output and "Failed validating" not in output and "'properties'" not in output, output
        assert len(output.strip().splitlines()) <= 8, output


# ---- arguments before models ------------------------------------------------------------------------------------

def test_predict_argument_errors_exit_2_before_anything_is_read(tmp_path, capsys):
    main = predict_main()
    common = ["--model", str(tmp_path / "none"), "--text", "a"]
    cases = [
        (["--image", "x.png", "--top-k", "0"], "--top-k 0: must be at least 1"),
        (["--image", "x.png", "--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
        (["--image", "ftp://example.org/x.jpg"], "--image ftp://example.org/x.jpg: unsupported URL scheme 'ftp'"),
        (["--image", "x.png", "--draw", str(tmp_path / "x.gif")], f"--draw {tmp_path}/x.gif: unknown image suffix "
                                                                  "'.gif'; name it .png, .jpg or .jpeg"),
        (["--image", "x.png", "--boxes", "1,2,3"], "--boxes '1,2,3': expected four numbers X1,Y1,X2,Y2"),
    ]
    for extra, words in cases:
        line = argument_error(capsys, main, PREDICT, [*common, *extra])
        assert line.startswith(f"{PREDICT}: error: {words}"), line
    assert not list(tmp_path.iterdir())


def test_predict_names_what_a_path_is_instead(tmp_path, capsys):
    main = predict_main()
    photo = tmp_path / "photo.png"
    Image.new("RGB", (32, 24)).save(photo)
    (tmp_path / "folder").mkdir()
    (tmp_path / "model_file").write_text("x")
    cases = [
        (["--model", str(tmp_path / "model_file"), "--image", str(photo)],
         f"model directory {tmp_path}/model_file is a file, not a directory"),
        (["--model", str(tmp_path / "none"), "--image", str(tmp_path / "folder")],
         f"image {tmp_path}/folder is a directory, not an image file"),
        (["--model", str(tmp_path / "none"), "--image", str(tmp_path / "nowhere.png")],
         f"image {tmp_path}/nowhere.png does not exist"),
        (["--model", str(tmp_path / "none"), "--image", str(photo), "--boxes", "5000,5000,6000,6000"],
         f"query #0: box 5000,5000,6000,6000 is not inside image {photo} (32 x 24 pixels"),
        (["--model", str(tmp_path / "none"), "--image", str(photo), "--config", str(tmp_path / "folder")],
         f"--config {tmp_path}/folder is a directory, not a file"),
        (["--model", str(tmp_path / "none"), "--image", str(photo), "--queries", str(tmp_path / "folder")],
         f"--queries {tmp_path}/folder is a directory, not a file"),
        (["--model", str(tmp_path / "none"), "--image", str(photo), "--detector", str(tmp_path / "folder")],
         f"--detector {tmp_path}/folder is a directory, not a file"),
        (["--model", str(tmp_path / "none"), "--image", str(photo), "--out", str(tmp_path / "no/dir/out.json")],
         f"--out {tmp_path}/no/dir/out.json: its folder {tmp_path}/no/dir does not exist"),
    ]
    for extra, words in cases:
        assert run_command(main, PREDICT, [*extra, "--text", "a"]) == 1
        line = one_error_line(capsys)
        assert line.startswith(f"{PREDICT}: error: {words}"), line


def test_predict_on_cuda_without_cuda_says_how_to_run_on_the_cpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    photo = tmp_path / "photo.png"
    Image.new("RGB", (32, 24)).save(photo)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"task": {"name": "vqa"}}))
    assert run_command(predict_main(), PREDICT, ["--model", str(tmp_path / "model"), "--image", str(photo),
                                                 "--text", "a", "--device", "cuda"]) == 1
    line = one_error_line(capsys)
    assert "--device cuda: torch sees no CUDA device" in line and "--device cpu" in line


def test_pretrain_checks_its_inputs_before_writing_anything(tmp_path, capsys):
    import torch

    from vlbert_core.pretrain.__main__ import main

    config = _pretrain_config(tmp_path)
    line = argument_error(capsys, main, PRETRAIN, _pretrain_args(tmp_path, config, **{"--setting": "z"}))
    assert line.startswith(f"{PRETRAIN}: error: --setting 'z': not a pre-training setting; expected one of ")
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("x")
    cases = [
        ({"--cc-shards": str(tmp_path / "nope.tar")}, f"--cc-shards {tmp_path}/nope.tar does not exist"),
        ({"--roi-parquets": str(tmp_path / "folder")}, f"--roi-parquets {tmp_path}/folder is a directory, not a file"),
        ({"--detector": str(tmp_path / "nope.pt")}, f"--detector {tmp_path}/nope.pt does not exist"),
        ({"--init-from": str(tmp_path / "a_file")}, f"--init-from {tmp_path}/a_file is a file, not a directory"),
        ({"--init-from": str(tmp_path / "folder")}, f"--init-from {tmp_path}/folder has no config.json"),
        ({"--out": str(tmp_path / "a_file")}, f"--out {tmp_path}/a_file is a file, not a directory"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"--device": "cuda"}, "--device: device cuda, but torch sees no CUDA device on this machine; "
                                            "run on the CPU with --device cpu"))
    for override, words in cases:
        assert run_command(main, PRETRAIN, _pretrain_args(tmp_path, config, **override)) == 1
        line = one_error_line(capsys)
        assert line.startswith(f"{PRETRAIN}: error: {words}"), line
        assert not (tmp_path / "out").exists()   # no pretrain.rank0.log, no directory
    assert not list(tmp_path.rglob("*.log"))


def test_convert_says_that_out_dir_is_an_existing_file(tmp_path, capsys):
    from vlbert_core.convert.__main__ import main

    (tmp_path / "in.model").write_bytes(b"x")
    out = tmp_path / "out_file"
    out.write_text("keep me")
    assert run_command(main, CONVERT, ["vl-bert", str(tmp_path / "in.model"), str(out), "--bert-path", "x"]) == 1
    assert f"OUT_DIR {out} is an existing file, not a directory" in one_error_line(capsys)
    assert out.read_text() == "keep me"


# ---- strict output -----------------------------------------------------------------------------------------------

def test_a_non_finite_score_is_an_error_naming_the_model_never_nan_in_the_json(tmp_path, capsys):
    from vlbert_core.predict import PredictError
    from vlbert_core.predict.__main__ import emit

    out = tmp_path / "answers.json"
    payload = {"model": "results/finetune/vqa/full/full", "task": "vqa",
               "results": [{"answers": [{"answer": "yes", "score": 0.5}]}, {"answers": [{"score": float("nan")}]}]}
    with pytest.raises(PredictError, match=r"model results/finetune/vqa/full/full gave a non-finite number \(nan\) "
                                           r"as the answer of query #1 answers\[0\] score"):
        emit(payload, out)
    assert not out.exists() and capsys.readouterr().out == ""
    payload["results"][1]["answers"][0]["score"] = 0.25
    emit(payload, out)
    assert json.loads(out.read_text()) == payload


# ---- model files checked at load ---------------------------------------------------------------------------------

def test_nan_weights_in_any_model_file_are_refused_naming_the_tensor_and_file(world, tmp_path):  # noqa: F811
    from safetensors.torch import load_file, save_file

    from vlbert_core.models.common.heads import read_pretraining_heads
    from vlbert_core.models.registry import from_pretrained

    root, _ = world
    model = tmp_path / "pretrained"
    shutil.copytree(root / "pretrained", model)
    state = load_file(str(model / "model.safetensors"))
    key = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[key] = state[key].clone()
    state[key].view(-1)[0] = float("nan")
    save_file(state, str(model / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{model}/model.safetensors: tensor {key} holds non-finite values \(1 NaN"):
        from_pretrained(model)
    heads = tmp_path / "heads"
    heads.mkdir()
    import torch

    save_file({"mlm.bias": torch.tensor([0.0, float("inf")])}, str(heads / "heads.safetensors"))
    with pytest.raises(ValueError, match=rf"{heads}/heads.safetensors: tensor mlm.bias holds non-finite values "
                                         r"\(0 NaN, 1 infinite"):
        read_pretraining_heads(heads, ("mlm",))


@pytest.fixture(scope="module")
def tuned(world, module_tmp_path):  # noqa: F811
    """Tiny fine-tunes of VQA and RefCOCO+ on the tasks' world."""
    from vlbert_core.tasks.finetune import finetune

    root, sources = world
    out = module_tmp_path / "tuned"
    for task in ("vqa", "refcoco"):
        finetune(task, root / "pretrained", out / task, setting="full", schedule="half", schedule_factor=1.0,
                 hparams={**HPARAMS, "lr": 1e-2}, tune_frcnn=False, model_cfg=MODEL_CFG, sources=sources[task],
                 rois_paths=[str(root / f"rois/{task}/train.parquet")], seed=0)
    return out


def test_predict_refuses_nan_weights_and_shapes_that_do_not_match_in_one_line(tuned, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    photo = tmp_path / "photo.png"
    Image.new("RGB", (48, 40), (90, 20, 200)).save(photo)
    args = ["--image", str(photo), "--text", "top left thing", "--boxes", "2,2,20,20", "10,10,40,36"]

    nan = tmp_path / "nan"
    shutil.copytree(tuned / "refcoco", nan)
    state = load_file(str(nan / "model.safetensors"))
    key = sorted(k for k in state if k.startswith("head.") and state[k].is_floating_point())[0]
    state[key] = state[key] * float("nan")
    save_file(state, str(nan / "model.safetensors"))
    assert run_command(predict_main(), PREDICT, ["--model", str(nan), *args]) == 1
    line = one_error_line(capsys)
    assert f"{nan}/model.safetensors: tensor {key} holds non-finite values" in line, line

    # config.json's answer list one shorter than the head the weights hold
    short = tmp_path / "short"
    shutil.copytree(tuned / "vqa", short)
    config = json.loads((short / "config.json").read_text())
    answers = config["task"]["answers"]
    config["task"]["answers"] = answers[:-1]
    (short / "config.json").write_text(json.dumps(config))
    assert run_command(predict_main(), PREDICT, ["--model", str(short), "--image", str(photo), "--text", "a"]) == 1
    line = one_error_line(capsys)
    assert f"{short}/model.safetensors: tensor head." in line and f"[{len(answers)}" in line, line
    assert f"expects [{len(answers) - 1}" in line and f"task.answers (a list of {len(answers) - 1})" in line, line
    assert "Error(s) in loading state_dict" not in line and "frozen_stages" not in line

    # a tensor whose shape was changed in model.safetensors
    changed = tmp_path / "changed"
    shutil.copytree(tuned / "refcoco", changed)
    state = load_file(str(changed / "model.safetensors"))
    key = sorted(k for k, v in state.items() if v.ndim == 2)[0]
    expected = list(state[key].shape)
    state[key] = state[key][:-1].clone()
    save_file(state, str(changed / "model.safetensors"))
    assert run_command(predict_main(), PREDICT, ["--model", str(changed), *args]) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"{PREDICT}: error: {changed}/model.safetensors: tensor {key} has shape "
                           f"{[expected[0] - 1, expected[1]]}, but the model that {changed}/config.json describes "
                           f"expects {expected}"), line


def test_an_exif_rotated_photo_gives_the_answer_and_box_of_its_upright_copy(world, tuned, tmp_path, capsys):  # noqa: F811
    root, sources = world
    image = sorted(Path(sources["refcoco"]["images"]).glob("*.jpg"))[0]
    with Image.open(image) as original:
        upright = original.convert("RGB")
    rotated = tmp_path / "rotated.jpg"
    rotated.write_bytes(exif_rotated(upright))
    from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb

    # the upright copy: the rotated photo's pixels as a viewer sees them, losslessly
    copy = tmp_path / "upright.png"
    load_rgb(rotated, max_pixels=DEFAULT_MAX_PIXELS).save(copy)
    boxes = ["2,2,20,20", "24,4,46,38", "8,20,30,39"]
    results = {}
    for name, path in (("rotated", rotated), ("upright", copy)):
        drawn = tmp_path / f"{name}_drawn.jpg"
        answer = predict_main()(["--model", str(tuned / "refcoco"), "--image", str(path), "--text", "right thing",
                                 "--boxes", *boxes, "--draw", str(drawn)])["results"][0]
        with Image.open(drawn) as picture:
            assert picture.format == "JPEG" and picture.size == upright.size == (48, 40)   # upright, and JPEG bytes
        results[name] = {k: answer[k] for k in ("box", "score", "top")}
    capsys.readouterr()
    assert results["rotated"] == results["upright"]


def test_a_9000x2_image_is_refused_naming_it_and_its_size(tuned, tmp_path, capsys):
    thin = tmp_path / "thin.png"
    Image.new("RGB", (9000, 2), (1, 2, 3)).save(thin)
    assert run_command(predict_main(), PREDICT, ["--model", str(tuned / "refcoco"), "--image", str(thin),
                                                 "--text", "a", "--boxes", "0,0,100,2"]) == 1
    line = one_error_line(capsys)
    assert f"image {thin} is 9000x2 pixels" in line and "shorter side 0 pixels" in line, line
    assert "Input and output sizes" not in line
