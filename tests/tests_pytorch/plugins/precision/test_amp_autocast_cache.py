"""Autocast's weight cache under ``MixedPrecision``: on by default where torch makes it safe, refreshed after every
optimizer step, and a clear error (naming the switch) where a cached cast would have the wrong dtype."""

import pytest
import torch
from torch import nn

from lightning.fabric.plugins.precision.amp_recipe import _AUTOCAST_CACHE_IS_SAFE
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision


class SharedWeightAcrossDtypes(LightningModule):
    """Uses one layer inside a float16 autocast region and again in the bfloat16 rest of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        with torch.autocast("cpu", dtype=torch.float16):
            inner = self.layer(batch)
        outer = self.layer(batch)
        return (inner.float() + outer.float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)


def _fit(model: LightningModule, plugin: MixedPrecision) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return trainer


def test_cache_default_follows_torch_version():
    assert MixedPrecision("bf16-mixed", "cpu").cache_enabled is _AUTOCAST_CACHE_IS_SAFE
    assert MixedPrecision("bf16-mixed", "cpu").autocast_context_manager()._cache_enabled is _AUTOCAST_CACHE_IS_SAFE
    assert MixedPrecision("bf16-mixed", "cpu", cache_enabled=False).autocast_context_manager()._cache_enabled is False


@pytest.mark.skipif(not _AUTOCAST_CACHE_IS_SAFE, reason="the cache is off by default before torch 2.11")
def test_weight_in_two_dtypes_names_the_switch():
    model = SharedWeightAcrossDtypes()
    before = model.layer.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"cache_enabled=False") as info:
        _fit(model, MixedPrecision("bf16-mixed", "cpu"))
    assert "dtype" in str(info.value.__cause__)  # torch's own error is kept as the cause
    assert torch.equal(model.layer.weight, before)  # nothing was computed with the wrongly typed cast


def test_weight_in_two_dtypes_runs_with_cache_off():
    model = SharedWeightAcrossDtypes()
    before = model.layer.weight.detach().clone()
    _fit(model, MixedPrecision("bf16-mixed", "cpu", cache_enabled=False))
    assert not torch.equal(model.layer.weight, before)


@pytest.mark.skipif(_AUTOCAST_CACHE_IS_SAFE, reason="only refused where torch's cache is unsafe")
def test_cache_refused_where_unsafe():
    with pytest.raises(ValueError, match="torch >= 2.11"):
        MixedPrecision("bf16-mixed", "cpu", cache_enabled=True)


class ReusesWeightAfterStep(LightningModule):
    """Steps, then runs the same layer again: the second forward must see the updated weight, not a cached cast."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(4, 4, bias=False)
        self.stale = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.layer(batch).float().pow(2).sum())
        opt.step()
        opt.zero_grad()
        after = self.layer(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            expected = self.layer(batch)
        self.stale.append(not torch.equal(after, expected))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)


def test_forward_after_step_sees_updated_weights():
    model = ReusesWeightAfterStep()
    _fit(model, MixedPrecision("bf16-mixed", "cpu"))
    assert model.stale == [False, False]
