"""Training loops that the differential corpus did not have, each against PyTorch's recipe written by hand
(the Trainer's side; Fabric's cases are in ``tests_fabric/plugins/precision/test_amp_fabric_recipe.py``).

Each test names its case. Power-of-two scales and ``growth_interval=1`` make every update show in the scale.
"""

import copy

import pytest
import torch
from amp_oracle.torch_features import requires_cpu_16_mixed
from amp_oracle.trainer import FORK, STOCK, lightning_api, make_trainer, quiet_trainer
from amp_oracle.world import new_scaler
from torch import nn

from lightning.pytorch import Callback, LightningModule

pytestmark = requires_cpu_16_mixed

N = 16


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_trainer():
        yield


def _batches(n: int = N) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=gen) for _ in range(n)]


def _loss(net: nn.Module, batch: torch.Tensor, inf: bool) -> torch.Tensor:
    loss = net(batch).float().pow(2).mean()
    return loss * float("inf") if inf else loss


class _Module(LightningModule):
    def __init__(self, inf_at: tuple[int, ...] = (2,)) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Linear(8, 4)
        self.inf_at = inf_at
        self.seen: list = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.cat(_batches()), batch_size=4)


class ClipAfterStep(_Module):
    """``self.clip_gradients`` after ``opt.step()``, to log the norm."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(_loss(self.net, batch, batch_idx in self.inf_at))
        opt.step()
        self.seen.append(float(self.clip_gradients(opt, gradient_clip_val=1e6, gradient_clip_algorithm="norm")))


def test_clip_after_the_step_changes_nothing_and_returns_the_true_norm():
    model = ClipAfterStep()
    twin = copy.deepcopy(model.net)
    trainer = make_trainer(lightning_api(FORK), "16-mixed", scaler=new_scaler(), max_epochs=1)
    trainer.fit(model)
    opt, scaler, norms = torch.optim.SGD(twin.parameters(), lr=0.1), new_scaler(), []
    for i, batch in enumerate(_batches()):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(twin, batch, i in model.inf_at)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        norms.append(float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e6)))
    assert trainer.precision_plugin._recipe.updates == N  # one per iteration, not two
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()
    assert all(torch.equal(p, q) for p, q in zip(model.net.parameters(), twin.parameters()))
    finite = [(a, b) for a, b in zip(model.seen, norms) if b == b and b != float("inf")]
    assert finite and all(a == pytest.approx(b) for a, b in finite)


class SkipIdiom(_Module):
    """``scale = scaler.get_scale(); opt.step(); skipped = scaler.get_scale() < scale``."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(_loss(self.net, batch, batch_idx in self.inf_at))
        scaler = self.trainer.precision_plugin.scaler
        scale = scaler.get_scale()
        opt.step()
        self.seen.append(scaler.get_scale() < scale)


def test_a_plugin_reused_by_a_second_trainer_sees_the_second_fits_skips():
    """One ``MixedPrecision`` for two Trainers, the first still alive: the first fit's optimizer is not one of
    the second fit's, so the update follows the second fit's step and the ``get_scale()`` idiom sees its skip."""
    api = lightning_api(FORK)
    first = make_trainer(api, "16-mixed", scaler=new_scaler(growth_interval=1000))  # skips only where injected
    plugin = first.precision_plugin
    first_model = SkipIdiom()
    first.fit(first_model)
    second = make_trainer(api, "16-mixed", plugin=plugin)
    model = SkipIdiom(inf_at=(5,))
    second.fit(model)
    assert first_model.seen == [i == 2 for i in range(N)]
    assert model.seen == [i == 5 for i in range(N)]
    assert first.strategy.optimizers  # the first fit's optimizer is alive all along


@pytest.mark.parametrize("when", ["between-fits", "on-train-start"])
def test_a_replaced_scaler_is_the_one_the_next_fit_drives(when):
    """``plugin.scaler = ...`` between two fits, or in a callback's ``on_train_start`` (after the fit's optimizers were
    set up): the second fit scales, skips and updates with the new scaler, and the old one stays as the first fit left
    it."""
    api = lightning_api(FORK)
    first = make_trainer(api, "16-mixed", scaler=new_scaler(growth_interval=1000))
    plugin = first.precision_plugin
    first.fit(SkipIdiom())
    old_scaler, old_state = plugin.scaler, plugin.scaler.state_dict()

    class ReplaceScaler(Callback):
        def on_train_start(self, trainer, pl_module):
            plugin.scaler = new_scaler(growth_interval=1000)

    if when == "between-fits":
        plugin.scaler = new_scaler(growth_interval=1000)
    model = SkipIdiom(inf_at=(5,))
    make_trainer(api, "16-mixed", plugin=plugin, callbacks=[ReplaceScaler()] if when == "on-train-start" else []).fit(
        model
    )
    assert model.seen == [i == 5 for i in range(N)]
    assert old_scaler.state_dict() == old_state
    assert plugin.scaler is not old_scaler
    assert plugin.scaler.get_scale() == old_state["scale"]  # both backed off once, from the same initial scale


# --------------------------------------------------------------------------------------------------------------------
# host reads per step: no more than the same loop on stock 2.6.6, whose scaler reads what torch's recipe reads
# --------------------------------------------------------------------------------------------------------------------


class _HostReads:
    """Counts the reads of a tensor's value on the host (``item``, ``__bool__``, ``__float__``, ``tolist``): on CUDA
    each is a stream synchronisation."""

    NAMES = ("item", "__bool__", "__float__", "tolist")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.on = False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            if self.on:
                self.count += 1
            return original(tensor, *args, **kwargs)

        return read


class AutomaticFusedWithStepScheduler:
    """Automatic optimization, ``AdamW(fused=True)`` and an ``interval="step"`` scheduler: holding the scheduler on a
    skipped step reads the fused kernel's inf check, one read per step (documented; torch's own idiom,
    ``scaler.get_scale()`` before and after the step, reads two)."""

    reads_per_step = 1

    def __init__(self, reads: _HostReads) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 4)
        self.reads = reads

    def training_step(self, batch, batch_idx):
        self.reads.on = batch_idx >= 4  # the steady state
        return _loss(self.net, batch, False)

    def on_train_batch_end(self, *args) -> None:
        self.reads.on = False

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "step"}]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.cat(_batches()), batch_size=4)


class TwoNetworksEachClippedAfterItsBackward:
    """Manual optimization: two networks, each clipped right after its own backward, then both step."""

    reads_per_step = 0

    def __init__(self, reads: _HostReads) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.nets = nn.ModuleList([nn.Linear(8, 4), nn.Linear(8, 4)])
        self.reads = reads

    def training_step(self, batch, batch_idx):
        self.reads.on = batch_idx >= 4
        opts = self.optimizers()
        for net, opt in zip(self.nets, opts):
            opt.zero_grad()
            self.manual_backward(_loss(net, batch, False))
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        for opt in opts:
            opt.step()
        self.reads.on = False

    def configure_optimizers(self):
        return [torch.optim.SGD(net.parameters(), lr=0.1) for net in self.nets]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.cat(_batches()), batch_size=4)


@pytest.mark.parametrize("module", [AutomaticFusedWithStepScheduler, TwoNetworksEachClippedAfterItsBackward])
def test_host_reads_per_step_are_stocks_but_the_documented_ones(module, monkeypatch):
    from amp_oracle.torch_features import requires_cpu_fused

    if module is AutomaticFusedWithStepScheduler and requires_cpu_fused("AdamW").args[0]:
        pytest.skip("no fused CPU AdamW in this torch")
    counts = {}
    for package in (FORK, STOCK):
        api = lightning_api(package)
        reads = _HostReads(monkeypatch)
        model = type(module.__name__, (module, api.LightningModule), {})(reads)  # each package's own LightningModule
        make_trainer(api, "16-mixed", scaler=new_scaler(growth_interval=1000)).fit(model)
        counts[package] = reads.count
        monkeypatch.undo()
    assert counts[FORK] <= counts[STOCK] + module.reads_per_step * (N - 4), counts


class CriticLoop(LightningModule):
    """A WGAN-style loop, the critic stepped ``N_CRITIC`` times, then the generator."""

    N_CRITIC = 3

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator, self.critic = nn.Linear(8, 8), nn.Linear(8, 1)
        self.scales: list = []

    def training_step(self, batch, batch_idx):
        c_opt, g_opt = self.optimizers()
        for _ in range(self.N_CRITIC):
            c_opt.zero_grad()
            self.manual_backward(_critic_loss(self.generator, self.critic, batch))
            c_opt.step()
        g_opt.zero_grad()
        self.manual_backward(_generator_loss(self.generator, self.critic, batch))
        g_opt.step()

    def on_train_batch_end(self, *args) -> None:
        self.scales.append(self.trainer.precision_plugin.scaler.get_scale())

    def configure_optimizers(self):
        return torch.optim.SGD(self.critic.parameters(), lr=0.01), torch.optim.SGD(self.generator.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.cat(_batches(6)), batch_size=4)


def _critic_loss(generator: nn.Module, critic: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (critic(generator(batch).detach()) - critic(batch)).float().mean()


def _generator_loss(generator: nn.Module, critic: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return -critic(generator(batch)).float().mean()


def test_a_critic_stepped_several_times_gets_an_update_after_each_step():
    """torch's only legal loop for an optimizer stepped several times per batch is an update after each step;
    from a scale that overflows, the scale backs off after every step, not once per batch."""
    model = CriticLoop()
    generator, critic = copy.deepcopy(model.generator), copy.deepcopy(model.critic)
    trainer = make_trainer(lightning_api(FORK), "16-mixed", scaler=new_scaler(init_scale=2.0**30))
    trainer.fit(model)
    c_opt, g_opt = torch.optim.SGD(critic.parameters(), lr=0.01), torch.optim.SGD(generator.parameters(), lr=0.01)
    scaler, scales = new_scaler(init_scale=2.0**30), []
    for batch in _batches(6):
        for opt, loss_fn in [(c_opt, _critic_loss)] * CriticLoop.N_CRITIC + [(g_opt, _generator_loss)]:
            opt.zero_grad()
            # manual optimization runs without autocast's weight cache: the twin too (a cached cast would sum the two
            # critic calls' gradients in float16)
            with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                loss = loss_fn(generator, critic, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        scales.append(scaler.get_scale())
    assert model.scales == scales
    for net, twin in ((model.generator, generator), (model.critic, critic)):
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), twin.parameters()))
