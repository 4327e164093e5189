"""vlbert_core/training.py (one resumable training run) and the typed settings read at the boundary."""

import pytest
import torch
from torch import nn

from vlbert_core.models.common.config import ModelSettings
from vlbert_core.pretrain.config import PretrainSettings
from vlbert_core.tasks.settings import FinetuneSettings
from vlbert_core.training import TrainingRun

PRETRAIN = {"steps": 4, "cc_batch_size": 2, "text_batch_size": 2, "lr_per_sample": 1, "weight_decay": 0.01,
            "warmup_steps": 1, "clip_grad": 1.0, "max_text_len": 16, "max_caption_len": 12, "checkpoint_every": 2,
            "streams_per_rank": 1, "stream_workers": False, "held_out_per_shard": 1, "settings": ["a"],
            "collective_timeout_s": 30}


# ---- typed settings --------------------------------------------------------------------------------

def test_pretrain_settings_typed_and_fingerprinted_as_written():
    hp = PretrainSettings.from_config(PRETRAIN)
    assert hp.steps == 4 and hp.lr_per_sample == 1.0 and isinstance(hp.lr_per_sample, float)
    assert hp.visual_lr_scale == 1.0 and hp.collective_timeout_s == 30.0 and hp.stream_workers is False
    # the fingerprint hashes the section as written (an int stays an int), less settings and the timeout
    fingerprint = hp.to_fingerprint()
    assert fingerprint == {k: v for k, v in PRETRAIN.items() if k not in ("settings", "collective_timeout_s")}
    assert type(fingerprint["lr_per_sample"]) is int
    assert PretrainSettings.of(hp) is hp


def test_pretrain_settings_name_the_bad_key():
    with pytest.raises(KeyError, match=r"config section 'pretrain' lacks keys \['clip_grad'\]"):
        PretrainSettings.from_config({k: v for k, v in PRETRAIN.items() if k != "clip_grad"})
    with pytest.raises(TypeError, match=r"pretrain\.steps must be an integer, not str '4'"):
        PretrainSettings.from_config({**PRETRAIN, "steps": "4"})
    with pytest.raises(TypeError, match=r"pretrain\.cc_batch_size must be an integer, not bool"):
        PretrainSettings.from_config({**PRETRAIN, "cc_batch_size": True})
    with pytest.raises(TypeError, match=r"pretrain\.stream_workers must be true or false"):
        PretrainSettings.from_config({**PRETRAIN, "stream_workers": 0})
    with pytest.raises(ValueError, match="must be >= 1"):
        PretrainSettings.from_config({**PRETRAIN, "checkpoint_every": 0}).check_schedule()


def test_finetune_settings():
    hp = FinetuneSettings.for_task("vqa", {"epochs": 1, "batch_size": 2, "lr": 1e-3, "optimizer": "sgd",
                                           "num_answers": 8, "lr_steps": [1, 0.5], "checkpoint_every": 5})
    assert hp.epochs == 1.0 and hp.lr_steps == (1.0, 0.5) and hp.momentum == 0.9 and hp.max_examples is None
    assert hp.hparams["num_answers"] == 8 and hp.hparams["clip_grad"] == 1.0   # defaults filled in for the task
    assert "checkpoint_every" not in hp.to_fingerprint() and hp.to_fingerprint()["lr_steps"] == [1, 0.5]
    assert hp.optimizer_settings().lr == 1e-3 and hp.optimizer_settings().momentum == 0.9
    with pytest.raises(KeyError, match=r"finetune.vqa lacks keys \['num_answers'\]"):
        FinetuneSettings.for_task("vqa", {"epochs": 1, "batch_size": 2, "lr": 1e-3, "optimizer": "sgd"})
    with pytest.raises(TypeError, match=r"finetune\.vqa\.batch_size must be an integer, not float 2.5"):
        FinetuneSettings.for_task("vqa", {"epochs": 1, "batch_size": 2.5, "lr": 1e-3, "optimizer": "sgd",
                                          "num_answers": 8})
    with pytest.raises(ValueError, match=r"finetune.refcoco.optimizer must be 'adamw' or 'sgd'"):
        FinetuneSettings.for_task("refcoco", {"epochs": 1, "batch_size": 2, "lr": 1e-3, "optimizer": "adam"})


def test_model_settings():
    section = {"max_rois": 5, "image_max_side": 32, "bert_path": "x", "task_heads": "released"}
    model = ModelSettings.from_config(section)
    assert (model.max_rois, model.image_max_side, model.image_min_side, model.task_heads) == (5, 32, None, "released")
    assert model.to_fingerprint() == section and model.section == section
    with pytest.raises(KeyError, match=r"'model' lacks keys \['image_max_side'\]"):
        ModelSettings.from_config({"max_rois": 5})
    with pytest.raises(TypeError, match=r"model\.image_min_side must be an integer, not str"):
        ModelSettings.from_config({**section, "image_min_side": "600"})


# ---- the training run ------------------------------------------------------------------------------

class Batches:
    """Seeded random batches whose position is their state."""

    def __init__(self):
        self.position = 0

    def __next__(self):
        g = torch.Generator().manual_seed(self.position)
        self.position += 1
        return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)

    def state(self):
        return {"position": self.position}

    def load_state(self, state):
        self.position = state["position"]


def _run(out, stop_after_step=None, fingerprint="f", steps=6, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1))   # dropout: the RNG state matters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / steps)
    batches = Batches()
    run = TrainingRun(out, "toy", fingerprint=fingerprint, checkpoint_format=1, total_steps=steps,
                      parts={"model": model, "optimizer": optimizer, "scheduler": scheduler}, data=batches,
                      device=torch.device("cpu"), checkpoint_every=2, **kwargs)
    run.resume()

    def step(n):
        x, y = next(batches)
        lr = scheduler.get_last_lr()[0]
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        return {"step": n, "loss": loss.item(), "lr": lr}

    stopped = run.train(step, stop_after_step)
    run.close()
    return run, model, stopped


@pytest.mark.parametrize("kwargs", [{}, {"per_rank": True, "final_checkpoint": True, "labels": {"setting": "x"}},
                                    {"timed": True}])
def test_a_stopped_run_resumes_to_the_weights_of_an_unbroken_one(tmp_path, kwargs):
    straight, straight_model, stopped = _run(tmp_path / "straight", **kwargs)
    assert not stopped and [r["step"] for r in straight.metrics] == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "straight/checkpoint.pt").exists()   # steps 2 and 4 (and 6 with final_checkpoint)

    first, _, stopped = _run(tmp_path / "broken", stop_after_step=3, **kwargs)
    assert stopped and first.step == 3
    ckpt = torch.load(tmp_path / "broken/checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 3 and ckpt["format"] == 1 and ckpt["fingerprint"] == "f"
    assert list(ckpt) == ["format", "fingerprint", *kwargs.get("labels", {}), "step", "model", "optimizer",
                          "scheduler", "data", "rng", "metrics", *(["train_seconds"] if kwargs.get("timed") else [])]
    assert isinstance(ckpt["data"], list) == bool(kwargs.get("per_rank"))

    resumed, resumed_model, stopped = _run(tmp_path / "broken", **kwargs)
    assert not stopped and resumed.resumed_from == 3 and resumed.metrics == straight.metrics
    for key, value in straight_model.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[key], value), key


def test_a_checkpoint_of_another_run_is_not_resumed(tmp_path, caplog):
    _run(tmp_path, stop_after_step=2)
    other, _, _ = _run(tmp_path, fingerprint="another configuration")
    assert other.resumed_from is None and "belongs to another configuration" in caplog.text
