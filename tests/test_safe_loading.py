"""Reading files from outside: restricted unpickling and the key accounting of converters."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from vlbert_core.convert.accounting import ConversionError, Drop, Rule, convert_state_dict
from vlbert_core.convert.manifest import Manifest, read_published, write_stand_in
from vlbert_core.safe_pickle import UnsafePickleError, load_pickle


class _RunsCode:
    """Unpickling this calls os.system: what a hostile pickle looks like."""

    def __init__(self, marker: str = "/dev/null"):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_pickle_that_runs_code_is_refused_naming_file_and_global(tmp_path):
    path = tmp_path / "weights.pkl"
    path.write_bytes(pickle.dumps({"model": {"w": _RunsCode()}}, protocol=2))
    with pytest.raises(UnsafePickleError) as err:
        load_pickle(path)
    assert str(path) in str(err.value)
    assert "os.system" in str(err.value) or "posix.system" in str(err.value)


def test_numpy_pickle_loads(tmp_path):
    path = tmp_path / "weights.pkl"
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.int64(3)}
    path.write_bytes(pickle.dumps({"model": arrays, "__author__": "x"}, protocol=2))
    loaded = load_pickle(path)
    np.testing.assert_array_equal(loaded["model"]["a"], arrays["a"])
    assert loaded["__author__"] == "x"


def test_truncated_pickle_names_file(tmp_path):
    path = tmp_path / "refs(unc).p"
    path.write_bytes(pickle.dumps([{"ref_id": 1}], protocol=2)[:-3])
    with pytest.raises(pickle.UnpicklingError, match=r"refs\(unc\)\.p"):
        load_pickle(path)


def test_refcoco_refs_that_run_code_are_refused(tmp_path):
    from vlbert_core.tasks.refcoco import _load_refs

    path = tmp_path / "refs(unc).p"
    path.write_bytes(pickle.dumps([{"ref_id": 1, "sentences": _RunsCode()}], protocol=2))
    with pytest.raises(UnsafePickleError, match="os.system|posix.system"):
        _load_refs(path)


def _source():
    return {"enc.0.w": torch.ones(2, 3), "enc.1.w": torch.zeros(2, 3), "opt.step": torch.tensor(1)}


def test_accounting_maps_drops_and_reports():
    out, report = convert_state_dict(
        _source(), [Rule(r"enc\.(\d+)\.w", r"layer.\1.weight")], [Drop(r"opt\..*", "optimizer state")],
        {"layer.0.weight": (2, 3), "layer.1.weight": (2, 3)}, source_name="src")
    assert set(out) == {"layer.0.weight", "layer.1.weight"}
    assert torch.equal(out["layer.0.weight"], torch.ones(2, 3))
    assert report.dropped == {"opt.step": "optimizer state"}
    assert report.mapped["enc.1.w"] == "layer.1.weight"


@pytest.mark.parametrize("case, message", [
    ("unknown", "'opt.step'"), ("missing", "'layer.2.weight'"), ("shape", r"\(2, 3\).*\(3, 2\)"),
])
def test_accounting_fails_naming_the_key(case, message):
    rules = [Rule(r"enc\.(\d+)\.w", r"layer.\1.weight")]
    drops = [Drop(r"opt\..*", "optimizer state")]
    target = {"layer.0.weight": (2, 3), "layer.1.weight": (2, 3)}
    if case == "unknown":
        drops = []
    elif case == "missing":
        target["layer.2.weight"] = (2, 3)
    else:
        target["layer.1.weight"] = (3, 2)
    with pytest.raises(ConversionError, match=message):
        convert_state_dict(_source(), rules, drops, target, source_name="src")


@pytest.mark.parametrize("fmt, name", [("torch", "x.model"), ("pickle", "x.pkl")])
def test_stand_in_round_trip(tmp_path, fmt, name):
    manifest = Manifest(file=name, format=fmt, wrap=("state_dict",), extra={"epoch": 3},
                        tensors={"a.weight": ((4, 2), "float32"), "bn.running_var": ((4,), "float32")})
    arrays = write_stand_in(manifest, tmp_path / name, seed=1)
    tensors = read_published(tmp_path / name, manifest.wrap)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == manifest.shapes()
    assert np.allclose(tensors["a.weight"].numpy(), arrays["a.weight"])
    assert (tensors["bn.running_var"] > 0).all()
    with pytest.raises(ValueError, match="'model'"):
        read_published(tmp_path / name, ("model",))


def _hostile_torch_file(path, marker):
    torch.save({"state_dict": {"w": torch.zeros(1)}, "trap": _RunsCode(str(marker))}, path)


def _load_pretrain(path):
    from vlbert_core.safe_pickle import load_torch_file
    load_torch_file(path, "a pre-training checkpoint")


def _load_detector(path):
    from vlbert_core.detector import load_detector
    load_detector(path)


def _load_resnet(path):
    from vlbert_core.detector.resnet_c4 import ResNetC4Config, build_resnet_c4
    build_resnet_c4(ResNetC4Config(stage_widths=[4, 4, 4, 4], blocks_per_stage=[1, 1, 1, 1], init_weights=str(path)))


def _load_bert_bin(path):
    from vlbert_core.models.common.bert_init import load_bert_mlm_head_state
    (path.parent / "config.json").write_text("{}")
    load_bert_mlm_head_state(str(path.parent))


def _load_published(path):
    read_published(path, ("state_dict",))


def _load_refs(path):
    from vlbert_core.tasks.refcoco import _load_refs as load_refs
    load_refs(path)


@pytest.mark.parametrize("loader, name, kind", [
    (_load_pretrain, "checkpoint.pt", "torch"), (_load_detector, "model.pt", "torch"),
    (_load_resnet, "resnet.pth", "torch"), (_load_bert_bin, "pytorch_model.bin", "torch"),
    (_load_published, "vl-bert-base-e2e.model", "torch"), (_load_published, "faster_rcnn_from_caffe_attr.pkl", "pickle"),
    (_load_refs, "refs(unc).p", "pickle"),
])
def test_every_loader_refuses_a_code_running_file(tmp_path, loader, name, kind):
    """Each place that reads a file we did not write in this run refuses a doctored one: nothing runs,
    and the error names the file."""
    path, marker = tmp_path / name, tmp_path / "code-ran"
    if kind == "torch":
        _hostile_torch_file(path, marker)
    else:
        path.write_bytes(pickle.dumps({"model": {"w": _RunsCode(str(marker))}} if name.endswith(".pkl")
                                      else [{"ref_id": 1, "trap": _RunsCode(str(marker))}], protocol=2))
    with pytest.raises((ValueError, pickle.UnpicklingError)) as err:
        loader(path)
    assert str(path) in str(err.value)
    assert not marker.exists()
