"""The one initialisation of new parameters and the one safetensors writer/reader."""

import pytest
import torch
from torch import nn

from vlbert_core.models.common.initialization import init_new_parameters
from vlbert_core.utils import load_safetensors, save_safetensors


def test_init_new_parameters_draws_in_module_order():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Embedding(5, 2), nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        module[1].weight.fill_(7.0)
    torch.manual_seed(1)
    init_new_parameters(module, std=0.5)
    torch.manual_seed(1)
    expected = [torch.empty(3, 4).normal_(std=0.5), torch.empty(5, 2).normal_(std=0.5),
                torch.empty(2, 2).normal_(std=0.5)]
    assert torch.equal(module[0].weight, expected[0]) and torch.equal(module[0].bias, torch.zeros(3))
    assert torch.equal(module[1].weight, torch.ones(3)) and torch.equal(module[1].bias, torch.zeros(3))
    assert torch.equal(module[2].weight, expected[1]) and torch.equal(module[3].weight, expected[2])


def test_safetensors_round_trip_is_atomic_and_filters_keys(tmp_path):
    path = tmp_path / "out" / "model.safetensors"
    weight = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: the writer copies it
    save_safetensors({"head.weight": weight, "vlbert.bias": torch.ones(2, requires_grad=True)}, path,
                     metadata={"task": "vqa"})
    assert [p.name for p in path.parent.iterdir()] == ["model.safetensors"]
    loaded = load_safetensors(path)
    assert torch.equal(loaded["head.weight"], weight) and torch.equal(loaded["vlbert.bias"], torch.ones(2))
    assert list(load_safetensors(path, keep=lambda k: k.startswith("head."))) == ["head.weight"]
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"task": "vqa"}
    shared = torch.ones(4)
    with pytest.raises(RuntimeError):  # safetensors refuses tensors that share memory, mid-write
        save_safetensors({"x": shared, "y": shared[:2]}, path)
    assert load_safetensors(path).keys() == loaded.keys()  # the failed write left the old file whole
    assert [p.name for p in path.parent.iterdir()] == ["model.safetensors"]
