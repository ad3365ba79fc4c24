"""PyTorch's AMP recipe written by hand with the plugin's scaler, in manual optimization under 16-mixed:
``self.trainer.precision_plugin.scaler.scale(loss).backward()``, then ``opt.step()``. Stock Lightning trains it; the
fork's misuse watch, which refuses gradients a backward without the scale accumulated, must not take it for
``loss.backward()``: the plugin's scaler (the one Lightning creates, or one of torch's classes the user passes) tells
the plugin about the losses it scales. A backward without the scale is still refused."""

import copy
import pickle
import threading

import pytest
import torch
from tests_fabric.helpers.torch_features import GradScaler, requires_cpu_16_mixed
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning.fabric.plugins.precision.lightning_scaler import _TellsThePlugin
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
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


def _fit(model: LightningModule, scaler="lightning") -> Trainer:
    trainer = make_trainer(lightning_api(FORK), "16-mixed", scaler=scaler)
    trainer.fit(model)
    return trainer


def _users_scaler() -> GradScaler:
    # a power-of-two scale that the model's float16 gradients overflow at first: the scale backs off, then grows
    return GradScaler("cpu", init_scale=2.0**20, growth_interval=1)


@pytest.mark.parametrize("users", [False, True], ids=["lightnings-scaler", "users-scaler"])
def test_the_recipe_by_hand_with_the_plugins_scaler_trains_as_torchs(users):
    model = HandWrittenRecipe()
    twin = copy.deepcopy(model.layer)
    passed = _users_scaler() if users else None
    trainer = _fit(model, passed if users else "lightning")
    if users:
        assert trainer.precision_plugin.scaler is passed  # the user's object, served in place
    # Lightning's scaler's defaults, or the user's settings
    opt, scaler = torch.optim.SGD(twin.parameters(), lr=0.1), _users_scaler() if users else GradScaler("cpu")
    for batch in model.train_dataloader():
        with torch.autocast("cpu", dtype=torch.float16):  # the `training_step`'s backward runs under autocast too
            scaler.scale(twin(batch).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.layer.parameters(), twin.parameters()))
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()


class PluginsBackwardSeesItsMarks(HandWrittenRecipe):
    """``self.manual_backward(loss)`` with Lightning's scaler, recording during the backward how many times the watch
    counts it as a scaled backward on this thread."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        watch = self.trainer.precision_plugin._recipe._watch
        self.marks = []
        hidden = self.layer(batch)
        hidden.register_hook(lambda grad: self.marks.append(watch._in_flight_per_thread.get(threading.get_ident())))
        self.manual_backward(hidden.float().pow(2).mean())
        opt.step()
        opt.zero_grad()


def test_the_plugins_own_backward_is_marked_once():
    """The plugin's backward marks itself; Lightning's scaler does not mark it a second time (on CUDA its mark would
    run on a device thread, and turn every hook of the backward to the run's count)."""
    model = PluginsBackwardSeesItsMarks()
    _fit(model)
    assert model.marks == [1]


class HandWrittenRecipeCheckpointed(HandWrittenRecipe):
    """The same with a reentrant activation checkpoint: its segment backpropagates in a nested backward."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        hidden = checkpoint(self.layer, batch, use_reentrant=False)
        loss = checkpoint(self.head, hidden, use_reentrant=True).float().pow(2).mean()
        self.trainer.precision_plugin.scaler.scale(loss).backward()
        opt.step()
        opt.zero_grad()


def test_the_recipe_by_hand_with_a_reentrant_checkpoint_trains_as_torchs():
    model = HandWrittenRecipeCheckpointed()
    layer, head = copy.deepcopy(model.layer), copy.deepcopy(model.head)
    trainer = _fit(model)
    opt = torch.optim.SGD([*layer.parameters(), *head.parameters()], lr=0.1)
    scaler = GradScaler("cpu")
    for batch in model.train_dataloader():
        with torch.autocast("cpu", dtype=torch.float16):
            scaler.scale(head(layer(batch)).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), [*layer.parameters(), *head.parameters()]))
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()


class HandWrittenBackwardRaisesThenPlain(HandWrittenRecipe):
    """The first batch's hand-written scaled backward raises midway (caught: an OOM retried, say), so the autograd
    engine never runs its end-of-backward callback; the second batch calls ``loss.backward()``."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        hidden = self.layer(batch)
        loss = hidden.float().pow(2).mean()
        if batch_idx == 0:
            hidden.register_hook(self._fail)
            with pytest.raises(RuntimeError, match="midway"):
                self.trainer.precision_plugin.scaler.scale(loss).backward()
            opt.zero_grad()
            return
        loss.backward()
        opt.step()

    @staticmethod
    def _fail(grad):
        raise RuntimeError("the backward failed midway")


def test_a_hand_written_backward_that_raised_ends_with_its_iteration():
    """The scaled backward an exception left no longer counts once its iteration ended: the next batch's backward
    without the scale is refused."""
    with pytest.raises(RuntimeError, match="without the loss scale"):
        _fit(HandWrittenBackwardRaisesThenPlain())


@pytest.mark.parametrize("users", [False, True], ids=["lightnings-scaler", "users-scaler"])
def test_a_backward_without_the_scale_is_still_refused(users):
    with pytest.raises(RuntimeError, match="without the loss scale"):
        _fit(HandWrittenRecipe(scaled=False), _users_scaler() if users else "lightning")


def test_a_users_scaler_of_torchs_class_is_served_in_place():
    """The plugin gives the user's scaler a subclass of its own class: the same object, state and settings, still a
    ``GradScaler``; a copy and a pickle keep the subclass and the state."""
    scaler = _users_scaler()
    scaler.scale(torch.ones(()))
    scaler.update(2.0**10)  # state the plugin must not lose
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    assert plugin.scaler is scaler
    assert isinstance(scaler, GradScaler)
    assert isinstance(scaler, _TellsThePlugin)
    assert scaler._plugin is plugin
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (2.0**10, 1)
    for copied in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert type(copied) is type(scaler)
        assert copied.state_dict() == scaler.state_dict()
        assert type(copied._plugin) is MixedPrecision
        assert copied._plugin.scaler is copied
    # a second plugin (a second Trainer) takes the same scaler over, and its class stays the one subclass
    served = type(scaler)
    assert MixedPrecision("16-mixed", "cpu", scaler=scaler).scaler._plugin is not plugin
    assert type(scaler) is served



def test_a_pickled_plugin_is_still_told_by_its_scaler():
    """Launchers pickle the plugin (``ddp_spawn``): the copy of Lightning's scaler tells the copy of the plugin."""
    plugin = make_trainer(lightning_api(FORK), "16-mixed", scaler="lightning").precision_plugin
    assert plugin.scaler._plugin is plugin
    copied = pickle.loads(pickle.dumps(plugin))
    assert copied.scaler._plugin is copied
