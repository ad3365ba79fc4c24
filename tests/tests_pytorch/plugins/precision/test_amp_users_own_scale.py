"""PyTorch's AMP recipe written by hand with Lightning's own scaler, in manual optimization under 16-mixed:
``self.trainer.precision_plugin.scaler.scale(loss).backward()``, then ``opt.step()``. Stock Lightning trains it; the
fork's misuse watch, which refuses gradients a backward without the scale accumulated, must not take it for
``loss.backward()``: the scaler Lightning creates tells the plugin about the losses it scales. A backward without the
scale is still refused."""

import copy
import pickle

import pytest
import torch
from tests_fabric.helpers.torch_features import GradScaler, requires_cpu_16_mixed
from torch import nn

from lightning.pytorch import LightningModule, Trainer
from tests_pytorch.helpers.amp_recipe import FORK, lightning_api, make_trainer

# `precision="16-mixed"` gets a CPU scaler from Lightning from torch 2.3
pytestmark = requires_cpu_16_mixed


class HandWrittenRecipe(LightningModule):
    def __init__(self, scaled: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 4)
        self.scaled = scaled

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.layer(batch).float().pow(2).mean()
        scaler = self.trainer.precision_plugin.scaler
        (scaler.scale(loss) if self.scaled else loss).backward()
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=2)


def _fit(model: LightningModule) -> Trainer:
    trainer = make_trainer(lightning_api(FORK), "16-mixed", scaler="lightning")
    trainer.fit(model)
    return trainer


def test_the_recipe_by_hand_with_lightnings_scaler_trains_as_torchs():
    model = HandWrittenRecipe()
    twin = copy.deepcopy(model.layer)
    trainer = _fit(model)
    opt, scaler = torch.optim.SGD(twin.parameters(), lr=0.1), GradScaler("cpu")  # Lightning's scaler's defaults
    for batch in model.train_dataloader():
        with torch.autocast("cpu", dtype=torch.float16):  # the `training_step`'s backward runs under autocast too
            scaler.scale(twin(batch).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.layer.parameters(), twin.parameters()))
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()


def test_a_backward_without_the_scale_is_still_refused():
    with pytest.raises(RuntimeError, match="without the loss scale"):
        _fit(HandWrittenRecipe(scaled=False))


def test_a_pickled_plugin_is_still_told_by_its_scaler():
    """Launchers pickle the plugin (``ddp_spawn``): the copy of Lightning's scaler tells the copy of the plugin."""
    plugin = make_trainer(lightning_api(FORK), "16-mixed", scaler="lightning").precision_plugin
    assert plugin.scaler._plugin is plugin
    copied = pickle.loads(pickle.dumps(plugin))
    assert copied.scaler._plugin is copied
