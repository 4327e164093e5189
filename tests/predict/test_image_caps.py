"""One pixel cap for every place that opens an image (vlbert_core/images.py, issue #36).

A 12000x12000 PNG of about 18 kB (written here by hand: one bit per pixel, every row zero) is refused from its
header, with the same error (ImageTooLarge, naming the file and the config key max_image_pixels), by each entry
point: the core function, predict's command line, the task datasets' loader, the detector's decode (RoI
extraction, detector training), a CC shard sample, the custom task's row check (a refused row, not a crash) and
the CC resizer (status too_large). Each refusal takes well under a second and allocates no image memory
(Pillow's own allocation counter does not move), and Pillow's DecompressionBomb warning never shows.
"""

from __future__ import annotations

import io
import json
import struct
import time
import warnings
import zlib
from pathlib import Path

import pytest
from PIL import Image

from vlbert_core.images import (DEFAULT_MAX_PIXELS, MAX_PIXELS_KEY, ImageTooLarge, ImageUnreadable, NotAnImage,
                                checked_max_pixels, load_rgb, open_image)

SIDE = 12_000  # 144,000,000 pixels: over the default cap (and Pillow's warning limit), under Pillow's error limit


def bomb_png(width: int, height: int) -> bytes:
    """A valid 1-bit greyscale PNG of width x height black pixels, built without allocating its pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the row's bits
    packer = zlib.compressobj(9)
    body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, greyscale, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    started = time.perf_counter()
    path = tmp_path_factory.mktemp("bomb") / "huge.png"
    path.write_bytes(bomb_png(SIDE, SIDE))
    assert time.perf_counter() - started < 2.0 and path.stat().st_size < 100_000  # small and fast to write
    return path


def png(path: Path, size=(40, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 40, 40)).save(path)
    return path


class Refusal:
    """The call raises (or reports) the cap's refusal quickly, without allocating an image or warning
    (`other_images`: the block also decodes that many small images, of at most two allocations each)."""

    def __init__(self, other_images: int = 0):
        self.other_images = other_images

    def __enter__(self):
        self.allocations = Image.core.get_stats()["new_count"]
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.started
        self.warnings.__exit__(*exc)
        assert self.seconds < 1.0, f"the refusal took {self.seconds:.2f}s: more than reading a header"
        allocated = Image.core.get_stats()["new_count"] - self.allocations
        assert allocated <= 2 * self.other_images, "an image was allocated before the refusal"
        return False


def assert_names(message: str, *names: str, cap: int = DEFAULT_MAX_PIXELS) -> None:
    for name in names:
        assert name in message, (name, message)
    assert f"over the cap of {cap:,} pixels" in message and MAX_PIXELS_KEY in message, message


# ---- the one function ---------------------------------------------------------------------------------------

def test_open_image_refuses_from_the_header_a_path_or_bytes(bomb):
    with Refusal(), pytest.raises(ImageTooLarge) as err:
        open_image(bomb, max_pixels=DEFAULT_MAX_PIXELS)
    assert str(err.value) == (f"image {bomb} is 12000x12000 = 144,000,000 pixels, over the cap of 89,478,485 "
                              "pixels (config key max_image_pixels): refused before decoding; raise "
                              "max_image_pixels to use it")
    assert isinstance(err.value, ValueError) and (err.value.width, err.value.height) == (SIDE, SIDE)
    with Refusal(), pytest.raises(ImageTooLarge, match=r"image \(\d+ bytes\) is 12000x12000"):
        load_rgb(bomb.read_bytes(), max_pixels=DEFAULT_MAX_PIXELS)
    with Refusal(), pytest.raises(ImageTooLarge, match="image shard.tar sample 7 is 12000x12000"):
        load_rgb(bomb.read_bytes(), max_pixels=DEFAULT_MAX_PIXELS, name="shard.tar sample 7")


def test_the_cap_is_the_callers_on_both_sides_of_pillows_limit(bomb, tmp_path, monkeypatch):
    small = png(tmp_path / "small.png")  # 1,200 pixels
    assert load_rgb(small, max_pixels=1_200).size == (40, 30)
    with Refusal(), pytest.raises(ImageTooLarge, match="over the cap of 1,199 pixels"):
        load_rgb(small, max_pixels=1_199)
    # Above Pillow's own limit: the header opens without Pillow's warning, and Pillow's limit follows the cap
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with open_image(bomb, max_pixels=150_000_000) as image:
            assert image.size == (SIDE, SIDE)
    assert Image.MAX_IMAGE_PIXELS == 150_000_000
    # a cap below Pillow's limit never lowers it
    with Refusal(), pytest.raises(ImageTooLarge):
        open_image(bomb, max_pixels=1_000)
    assert Image.MAX_IMAGE_PIXELS == 150_000_000
    for bad in (0, -1, True, 1.5, "100", None):
        with pytest.raises(ValueError, match="max_image_pixels must be a positive integer"):
            checked_max_pixels(bad)


def test_unreadable_images_name_the_file(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(NotAnImage, match=f"image {tmp_path}/notes.png cannot be decoded: not in an image format"):
        open_image(tmp_path / "notes.png", max_pixels=DEFAULT_MAX_PIXELS)
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buffer, format="JPEG")
    (tmp_path / "cut.jpg").write_bytes(buffer.getvalue()[:300])
    with pytest.raises(ImageUnreadable, match=f"image {tmp_path}/cut.jpg cannot be decoded"):
        load_rgb(tmp_path / "cut.jpg", max_pixels=DEFAULT_MAX_PIXELS)
    with pytest.raises(NotAnImage, match="image x cannot be decoded: it is empty"):
        open_image(b"", max_pixels=DEFAULT_MAX_PIXELS, name="x")
    with pytest.raises(FileNotFoundError, match="nowhere.png does not exist"):
        open_image(tmp_path / "nowhere.png", max_pixels=DEFAULT_MAX_PIXELS)


# ---- predict ----------------------------------------------------------------------------------------------

def test_predict_refuses_a_huge_image_in_one_line_before_loading_the_model(bomb, tmp_path, capsys, monkeypatch):
    from vlbert_core.cli import run_command
    from vlbert_core.predict.__main__ import main

    prog = "python -m vlbert_core.predict"
    model = tmp_path / "model"  # never read: the image's header is checked first
    config = tmp_path / "config.yaml"
    config.write_text("max_image_pixels: 100000000\n")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # a cap above it raises it
    with Refusal():
        status = run_command(main, prog, ["--model", str(model), "--config", str(config),
                                          "--image", str(bomb), "--text", "what is it?"])
    assert status == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "DecompressionBomb" not in err[0], err
    assert err[0].startswith(f"{prog}: error: image {bomb} is 12000x12000")
    assert_names(err[0], str(bomb), cap=100_000_000)
    # the config's cap is the one applied: raised above the image, the model directory is what fails next
    config.write_text("max_image_pixels: 150000000\n")
    assert run_command(main, prog, ["--model", str(model), "--config", str(config),
                                    "--image", str(bomb), "--text", "what is it?"]) == 1
    assert str(model) in capsys.readouterr().err and Image.MAX_IMAGE_PIXELS >= 150_000_000


def test_a_drawn_answer_refuses_a_huge_image(bomb, tmp_path):
    from vlbert_core.predict.api import draw_box

    with Refusal(), pytest.raises(ImageTooLarge, match=str(bomb)):
        draw_box(bomb, [0, 0, 10, 10], tmp_path / "drawn.png")
    assert not (tmp_path / "drawn.png").exists()


# ---- the task datasets ------------------------------------------------------------------------------------

def test_task_images_are_capped(bomb, tmp_path):
    from vlbert_core.tasks.common import load_task_image
    from vlbert_core.tasks.samples import ImageLoader

    with Refusal(), pytest.raises(ImageTooLarge) as err:
        ImageLoader.from_settings({"image_max_side": 32}, max_pixels=DEFAULT_MAX_PIXELS)(bomb)
    assert_names(str(err.value), str(bomb))
    with Refusal(), pytest.raises(ImageTooLarge):
        load_task_image(bomb, 32)  # the default cap
    small = png(tmp_path / "small.png")
    assert ImageLoader(32, max_pixels=1_200)(small)[0].shape == (3, 24, 32)
    with pytest.raises(ImageTooLarge, match="over the cap of 1,000 pixels"):
        ImageLoader.from_settings({"image_max_side": 32}, max_pixels=1_000)(small)


# ---- the detector: RoI extraction and its training images ------------------------------------------------

def test_roi_extraction_records_a_huge_image_as_its_rows_error(bomb, tmp_path):
    from vlbert_core.detector.extract import decoded_batches
    from vlbert_core.detector.images import decode_image
    from vlbert_core.rois import STATUS_DECODE_ERROR, STATUS_OK

    with Refusal(), pytest.raises(ImageTooLarge, match=str(bomb)):
        decode_image(bomb)
    small = png(tmp_path / "small.png")
    samples = [("file", str(bomb)), ("ok", str(small)), ("train-000000003", bomb.read_bytes())]
    with Refusal():
        (batch,) = list(decoded_batches(samples[::2], batch_size=4))
    (_, none, status, error), (key, _, status2, error2) = batch
    assert none is None and status == status2 == STATUS_DECODE_ERROR
    assert error.startswith(f"ImageTooLarge: image {bomb} is 12000x12000")
    assert error2.startswith("ImageTooLarge: image 'train-000000003' is 12000x12000")
    (batch,) = list(decoded_batches(samples, batch_size=4, max_pixels=1_000))
    assert [row[2] for row in batch] == [STATUS_DECODE_ERROR] * 3 and "cap of 1,000" in batch[1][3]
    (batch,) = list(decoded_batches(samples[1:2], batch_size=4, max_pixels=1_200))
    assert batch[0][2] == STATUS_OK


def test_roi_extraction_writes_the_refused_row_and_goes_on(bomb, tmp_path):
    import torch
    from conftest import TINY_DETECTOR_CFG

    from vlbert_core.detector import build_detector, extract_rois_with_detector
    from vlbert_core.rois import read_rois

    torch.manual_seed(0)
    torch.save({"config": TINY_DETECTOR_CFG, "categories": [{"id": 1, "name": "thing"}], "num_classes": 1,
                "state_dict": build_detector(TINY_DETECTOR_CFG, num_classes=1).state_dict()}, tmp_path / "det.pt")
    select = {"score_threshold": 0.5, "min_boxes": 1, "max_boxes": 4, "nms_iou": 0.3, "batch_size": 2}
    samples = [("huge", str(bomb)), ("small", str(png(tmp_path / "small.png", (64, 48))))]
    counts = extract_rois_with_detector(tmp_path / "det.pt", samples, tmp_path / "rois.parquet", select,
                                        max_image_pixels=DEFAULT_MAX_PIXELS)
    assert counts == {"rows": 2, "ok": 1, "failed": 1}
    records = read_rois(tmp_path / "rois.parquet")
    assert records["small"].ok and records["huge"].status == "decode_error"
    assert_names(records["huge"].error, "ImageTooLarge", str(bomb))


def test_detector_training_images_are_capped(bomb, tmp_path):
    from vlbert_core.detector.train import load_coco_split

    annotations = tmp_path / "instances.json"
    annotations.write_text(json.dumps({"images": [{"id": 1, "file_name": bomb.name, "width": SIDE, "height": SIDE}],
                                       "annotations": [], "categories": [{"id": 1, "name": "thing"}]}))
    with Refusal(), pytest.raises(ImageTooLarge) as err:
        load_coco_split(annotations, bomb.parent)
    assert_names(str(err.value), str(bomb), f"image 1 of {annotations}")


# ---- pre-training: a CC shard's sample -------------------------------------------------------------------

def test_a_cc_sample_over_the_cap_names_its_shard_and_key(bomb):
    from vlbert_core.pretrain.data import StreamConfig, decode_cc_sample

    raw = {"png": bomb.read_bytes(), "txt": b"a black square", "__key__": "train-000000042",
           "__url__": "results/shards/cc/train-00000.tar"}
    with Refusal(), pytest.raises(ImageTooLarge) as err:
        decode_cc_sample(raw, None, 32, 5)
    assert_names(str(err.value), "'train-000000042' of CC shard results/shards/cc/train-00000.tar")
    cfg = StreamConfig(max_caption_len=12, max_text_len=16, max_rois=4, image_max_side=48, seed=0)
    assert cfg.max_image_pixels == DEFAULT_MAX_PIXELS
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30)).save(buffer, format="PNG")
    with pytest.raises(ImageTooLarge, match="over the cap of 1,000 pixels"):
        decode_cc_sample({**raw, "png": buffer.getvalue()}, None, 32, 5, max_pixels=1_000)


# ---- the custom task's row check --------------------------------------------------------------------------

def test_a_custom_row_with_a_huge_image_is_refused_with_the_reason(bomb, tmp_path):
    from vlbert_core.tasks.custom import UNREADABLE_IMAGE, CustomSpec, read_checked_rows
    from vlbert_core.tasks.custom_rows import check_rows

    data = tmp_path / "data"
    for i in range(4):
        png(data / f"{i}.png", (20 + i, 20))
    (data / "huge.png").write_bytes(bomb.read_bytes())
    rows = [{"image": f"{i}.png", "text": f"caption {i}", "label": "ab"[i % 2]} for i in range(4)]
    rows.append({"image": "huge.png", "text": "black", "label": "a"})
    for split in ("train", "val"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = CustomSpec.from_config("caps", {"train": str(data / "train.jsonl"), "val": str(data / "val.jsonl")})
    with Refusal(other_images=8):
        summary = check_rows(spec, tmp_path / "out", max_image_pixels=DEFAULT_MAX_PIXELS)
    assert summary["counts"]["train"] == {"ok": 4, UNREADABLE_IMAGE: 1}
    refused = read_checked_rows(tmp_path / "out/train.rows.jsonl")[4]
    assert refused["status"] == UNREADABLE_IMAGE and refused["line"] == 5
    assert_names(refused["reason"], str(data / "huge.png"))
    # the cap is the argument's: at 420 pixels, the 21x20 image and larger are refused too
    summary = check_rows(spec, tmp_path / "out2", max_image_pixels=420)
    assert summary["counts"]["train"] == {"ok": 2, UNREADABLE_IMAGE: 3}


# ---- the CC resizer ---------------------------------------------------------------------------------------

def test_the_cc_resizer_counts_a_huge_image_too_large(bomb):
    from vlbert_core.data import status as st
    from vlbert_core.data.resizer import ImageRejected, resize_image

    with Refusal(), pytest.raises(ImageRejected) as err:
        resize_image(bomb.read_bytes(), 64, name="https://example.org/huge.png")
    assert err.value.status == st.TOO_LARGE
    assert_names(str(err.value), "image https://example.org/huge.png is 12000x12000")
    with pytest.raises(ImageRejected) as err:
        resize_image(b"<html>moved</html>", 64)
    assert err.value.status == st.NOT_AN_IMAGE


def test_the_cc_shard_takes_the_top_level_cap_and_names_the_moved_key(tmp_path):
    from vlbert_core.data.cc import download_cc_shard

    with pytest.raises(ValueError, match="cc.resize.max_pixels is now the top-level max_image_pixels"):
        download_cc_shard(tmp_path / "rows.parquet", "train", 0, {"max_side": 64, "mode": "keep_ratio",
                                                                    "max_pixels": 10}, {}, tmp_path / "a.tar",
                          tmp_path / "a.parquet", tmp_path / "a.json")
    with pytest.raises(ValueError, match="max_image_pixels must be a positive integer"):
        download_cc_shard(tmp_path / "rows.parquet", "train", 0, {"max_side": 64, "mode": "keep_ratio"}, {},
                          tmp_path / "a.tar", tmp_path / "a.parquet", tmp_path / "a.json", max_image_pixels=0)


# ---- the config key ---------------------------------------------------------------------------------------

def test_the_config_key_is_validated_and_defaults_to_the_same_cap():
    import yaml
    from snakemake.utils import validate

    repo = Path(__file__).resolve().parents[2]
    schema = str(repo / "config" / "schema.yaml")
    config = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    del config[MAX_PIXELS_KEY]
    validate(config, schema)
    assert config[MAX_PIXELS_KEY] == DEFAULT_MAX_PIXELS
    for bad in (0, "big", 1.5):
        with pytest.raises(Exception, match=MAX_PIXELS_KEY):
            validate({**config, MAX_PIXELS_KEY: bad}, schema)
    moved = {**config, "cc": {**config["cc"], "resize": {**config["cc"]["resize"], "max_pixels": 1000}}}
    with pytest.raises(Exception, match="'max_pixels' was unexpected"):
        validate(moved, schema)
