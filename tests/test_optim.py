"""vlbert_core.optim: the parameter-group rule, the schedules, and the builders."""

import pytest
import torch
from torch import nn

from vlbert_core.optim import (
    OptimizerSettings, build_optimizer, build_scheduler, detectron_step_decay, parameter_groups, warmup_linear_decay,
    warmup_step_decay,
)


def test_warmup_linear_decay():
    factors = [warmup_linear_decay(s, 10, 4) for s in range(10)]
    # warm-up (s + 1) / 4, then (10 - s) / 6
    assert factors == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])
    assert warmup_linear_decay(10, 10, 4) == 0.0 and warmup_linear_decay(12, 10, 4) == 0.0
    assert [warmup_linear_decay(s, 3, 0) for s in range(3)] == pytest.approx([1.0, 2 / 3, 1 / 3])


def test_warmup_step_decay():
    factors = [warmup_step_decay(s, 2, [6, 8]) for s in range(10)]
    assert factors == pytest.approx([0.5, 1, 1, 1, 1, 1, 0.1, 0.1, 0.01, 0.01])


def test_detectron_step_decay():
    # warm-up from 1/3: s = 0 -> 1/3, s = 1 -> 1/3 * 3/4 + 1/4 = 1/2, s = 2 -> 2/3, s = 3 -> 5/6
    factors = [detectron_step_decay(s, 4, [6, 8], 1 / 3) for s in range(10)]
    assert factors == pytest.approx([1 / 3, 1 / 2, 2 / 3, 5 / 6, 1, 1, 0.1, 0.1, 0.01, 0.01])


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(5, 3)
        self.linear = nn.Linear(3, 2)
        self.norm = nn.LayerNorm(2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)


def test_parameter_groups_decay_matrices_only_in_module_order():
    module = _Tiny()
    decay, no_decay = parameter_groups(module, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(module.embedding.weight), id(module.linear.weight)]
    assert [id(p) for p in no_decay["params"]] == [id(module.linear.bias), id(module.norm.weight),
                                                   id(module.norm.bias)]


def test_build_optimizer_and_scheduler():
    module = _Tiny()
    adamw = build_optimizer(module, OptimizerSettings("adamw", lr=2.0, weight_decay=0.1, eps=1e-6))
    assert isinstance(adamw, torch.optim.AdamW) and len(adamw.param_groups) == 2
    assert adamw.param_groups[0]["eps"] == 1e-6 and adamw.param_groups[1]["weight_decay"] == 0.0
    sgd = build_optimizer(module, OptimizerSettings("sgd", lr=2.0, weight_decay=0.1, momentum=0.8, decay_all=True))
    assert isinstance(sgd, torch.optim.SGD) and len(sgd.param_groups) == 1
    assert sgd.param_groups[0]["weight_decay"] == 0.1 and sgd.param_groups[0]["momentum"] == 0.8
    assert len(sgd.param_groups[0]["params"]) == 5  # the frozen layer is left out

    scheduler = build_scheduler(adamw, lambda s: warmup_linear_decay(s, 4, 2))
    lrs = []
    for _ in range(4):
        lrs.append(scheduler.get_last_lr()[0])
        adamw.step()
        scheduler.step()
    assert lrs == pytest.approx([1.0, 2.0, 2.0, 1.0])  # factors 1/2, 1, (4 - 2) / 2, (4 - 3) / 2
    with pytest.raises(ValueError, match="adamw' or 'sgd"):
        OptimizerSettings("adam", lr=1.0, weight_decay=0.0)


def test_a_submodule_can_train_at_a_scaled_lr_under_the_same_schedule():
    module = _Tiny()
    settings = OptimizerSettings("adamw", lr=2.0, weight_decay=0.1)
    adamw = build_optimizer(module, settings, lr_scales=[(module.linear, 0.1)])
    by_param = {id(p): (g["lr"], g["weight_decay"]) for g in adamw.param_groups for p in g["params"]}
    assert by_param[id(module.linear.weight)] == (pytest.approx(0.2), 0.1)   # scaled, still decayed
    assert by_param[id(module.linear.bias)] == (pytest.approx(0.2), 0.0)
    assert by_param[id(module.embedding.weight)] == (2.0, 0.1)
    assert len(by_param) == 5 and len(adamw.param_groups) == 4
    scheduler = build_scheduler(adamw, lambda s: 0.5)
    assert sorted(scheduler.get_last_lr()) == pytest.approx([0.1, 0.1, 1.0, 1.0])
    # scale 1 leaves the groups as they were
    assert len(build_optimizer(module, settings, lr_scales=[(module.linear, 1.0)]).param_groups) == 2
