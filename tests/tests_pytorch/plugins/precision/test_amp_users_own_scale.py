"""PyTorch's AMP recipe written by hand with the plugin's scaler, in manual optimization under 16-mixed:
``self.trainer.precision_plugin.scaler.scale(loss).backward()``, then ``opt.step()``. Stock Lightning trains it, and so
does the fork: by default nothing watches the backwards (no hook, the user's scaler object untouched), and only the
free check runs (a step before the scaler scaled any loss raises, naming ``self.manual_backward``). The opt-in misuse
watch (``MixedPrecision(..., watch_misuse=True)``) also refuses ``loss.backward()`` next to scaled backwards; with it on,
a hand-written scaled backward is one it cannot see, as documented."""

import copy
import pickle

import pytest
import torch
from amp_oracle.torch_features import GradScaler, requires_cpu_16_mixed
from amp_oracle.trainer import FORK, lightning_api, make_trainer
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

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


def _fit(model: LightningModule, scaler="lightning", watch_misuse: bool = False) -> Trainer:
    trainer = make_trainer(lightning_api(FORK), "16-mixed", scaler=scaler, watch_misuse=watch_misuse)
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
        assert trainer.precision_plugin.scaler is passed
        assert type(passed) is GradScaler  # the user's object is never modified
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


def _recipe_by_hand(model: "HandWrittenRecipe", scaler: GradScaler) -> nn.Module:
    twin = copy.deepcopy(model.layer)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for batch in model.train_dataloader():
        with torch.autocast("cpu", dtype=torch.float16):
            scaler.scale(twin(batch).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return twin


def test_one_scaler_for_two_plugins_trains_the_recipe_by_hand():
    """One ``GradScaler`` passed to two ``MixedPrecision`` plugins (two Trainers built up front); the
    first runs PyTorch's recipe by hand. No error, and the weights are the recipe's, as in stock."""
    scaler = _users_scaler()
    state = copy.deepcopy(scaler.__dict__)
    first, second = (make_trainer(lightning_api(FORK), "16-mixed", scaler=scaler) for _ in range(2))
    model = HandWrittenRecipe()
    twin = _recipe_by_hand(model, _users_scaler())
    first.fit(model)
    assert first.precision_plugin.scaler is second.precision_plugin.scaler is scaler
    assert type(scaler) is GradScaler and scaler.__dict__.keys() == state.keys()  # the user's object, unmodified
    assert all(torch.equal(p, q) for p, q in zip(model.layer.parameters(), twin.parameters()))


class ClipsAndSteps(HandWrittenRecipe):
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.layer(batch).float().pow(2).mean())
        self.clip_gradients(opt, gradient_clip_val=1.0)
        opt.step()
        opt.zero_grad()


def test_the_default_path_registers_no_hook(monkeypatch):
    """Without ``watch_misuse`` the fork puts no hook on parameters, tensors or autograd nodes: a manual 16-mixed fit
    with clipping registers none."""
    registered = []
    for cls, name in (
        (torch.Tensor, "register_post_accumulate_grad_hook"),
        (torch.Tensor, "register_hook"),
        (torch.nn.Module, "register_full_backward_hook"),
    ):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *args, _f=original, _n=name, **kw: (registered.append(_n), _f(*args, **kw))[1])
    model = ClipsAndSteps()
    trainer = _fit(model)
    assert registered == []
    assert trainer.precision_plugin._recipe.watch is None


class PlainAfterManual(HandWrittenRecipe):
    """A correct first batch, then ``loss.backward()`` instead of ``self.manual_backward(loss)``."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.layer(batch).float().pow(2).mean()
        self.manual_backward(loss) if batch_idx == 0 else loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("users", [False, True], ids=["lightnings-scaler", "users-scaler"])
def test_no_backward_through_the_scaler_raises_by_default_naming_manual_backward(users):
    """The free check: a step before the scaler scaled any loss (stock: torch's bare ``AssertionError``). The message
    leads with what to call."""
    with pytest.raises(RuntimeError, match=r"^Call `self.manual_backward\(loss\)` instead of `loss.backward\(\)`"):
        _fit(HandWrittenRecipe(scaled=False), _users_scaler() if users else "lightning")


def test_a_backward_without_the_scale_after_scaled_ones_is_refused_with_the_watch():
    with pytest.raises(RuntimeError, match=r"^Call `self.manual_backward\(loss\)`.*without the loss scale"):
        _fit(PlainAfterManual(), watch_misuse=True)
    _fit(PlainAfterManual())  # by default nothing watches: it trains, as stock does


def test_the_watch_switch_survives_pickling():
    """Launchers pickle the plugin (``ddp_spawn``): the copy keeps the switch."""
    plugin = MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"), watch_misuse=True)
    assert pickle.loads(pickle.dumps(plugin)).watch_misuse
