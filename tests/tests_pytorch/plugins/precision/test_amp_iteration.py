"""The gradient scaler's per-iteration bookkeeping under ``MixedPrecision``: one update per training batch, after its
last optimizer step, and never lost when the scaler's state is saved."""

import copy

import pytest
import torch
from amp_oracle.trainer import FORK, lightning_api, make_trainer
from amp_oracle.world import LOW_INIT_SCALE, new_scaler
from torch import nn

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision


class TinyModule(LightningModule):
    """One linear layer, SGD, ``samples`` seeded samples in batches of two."""

    lr = 0.01
    data_seed = 0
    samples = 6
    automatic = True

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = self.automatic
        self.layer = nn.Linear(4, 4)

    def loss(self, batch):
        return self.layer(batch).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        data = torch.randn(self.samples, 4, generator=torch.Generator().manual_seed(self.data_seed))
        return torch.utils.data.DataLoader(data, batch_size=2)


class TwoStepsPerBatch(TinyModule):
    automatic = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for _ in range(2):
            self.manual_backward(self.loss(batch))
            opt.step()
            opt.zero_grad()


class RecordScale(Callback):
    def __init__(self) -> None:
        self.scales = []
        self.pending = []

    def on_train_batch_end(self, trainer, *_):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        self.pending.append(trainer.precision_plugin._recipe.update_owed)


def _plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=new_scaler(init_scale=LOW_INIT_SCALE))


def _trainer(**trainer_kwargs):
    return make_trainer(lightning_api(FORK), "16-mixed", plugin=_plugin(), **trainer_kwargs)


def _fit_quietly(model: LightningModule, **trainer_kwargs):
    trainer = _trainer(**trainer_kwargs)
    trainer.fit(model)
    return trainer


def _twins(cls: type, *args):
    """Two instances of ``cls`` with the same weights: one for the Trainer, one for the hand-written recipe."""
    torch.manual_seed(0)
    model = cls(*args)
    return model, copy.deepcopy(model)


def _assert_same_params(model: nn.Module, reference: nn.Module) -> None:
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_one_optimizer_stepped_twice_per_batch_updates_after_each_step(tmp_path):
    """torch's scaler needs an update between two steps of one optimizer, and with one optimizer each step is the last
    of its step cycle: each is followed by its update, as in stock Lightning (several optimizers get one update per
    batch, see the two-optimizer cases)."""
    record = RecordScale()
    trainer = _fit_quietly(TwoStepsPerBatch(), callbacks=[record])
    # growth_interval=1 and finite gradients: each step grows the scale once
    assert record.scales == [2.0**6, 2.0**8, 2.0**10]
    assert record.pending == [False, False, False]
    checkpoint = tmp_path / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)["MixedPrecision"]
    assert saved["scale"] == 2.0**10


def test_state_dict_holds_a_pending_update_without_applying_it():
    plugin = _plugin()
    param = nn.Parameter(torch.ones(2))
    optimizer, other = torch.optim.SGD([param], lr=0.1), torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    for opt in (optimizer, other):  # two optimizers of the fit: the update waits for the other's step
        plugin._recipe.track(opt)
    plugin._recipe.scale(param.sum()).backward()
    plugin._recipe.step(optimizer)
    assert plugin._recipe.update_owed
    assert plugin.state_dict()["scale"] == 2.0**5  # what the run continues with after the iteration's update
    assert plugin._recipe.update_owed  # saving changed nothing
    assert plugin.scaler.get_scale() == 2.0**4
    plugin.training_iteration_end()  # one update, as without the save
    assert plugin.scaler.get_scale() == 2.0**5


def test_the_users_own_update_after_the_step_raises_as_in_stock():
    """The update follows the last optimizer's step at once (stock updates after every step): a ``scaler.update()``
    of the user's own after it finds no inf check, and torch's scaler raises, as with stock Lightning."""

    class UpdatesItself(TwoStepsPerBatch):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(self.loss(batch))
            opt.step()
            opt.zero_grad()
            self.trainer.precision_plugin.scaler.update()

    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        _fit_quietly(UpdatesItself())


class ClipsEveryBatchStepsEveryOther(TinyModule):
    """Gradient accumulation over two batches, but clipping on every batch (by a value that never binds): the first
    clip unscales gradients that no step consumes, and the next backward adds scaled gradients to them."""

    automatic, samples, data_seed = False, 8, 2

    def __init__(self, clip: bool = True, zero_before_next_backward: bool = False) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.clip = clip
        self.zero_before_next_backward = zero_before_next_backward

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.loss(batch))
        if self.clip:
            self.clip_gradients(opt, gradient_clip_val=1e9, gradient_clip_algorithm="value")
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        elif self.zero_before_next_backward:
            opt.zero_grad()


def test_gradients_unscaled_without_a_step_are_carried_across_the_batch_end():
    """Rule (c) with the carry: the batch's end updates (the clip recorded an inf check) and carries the unscaled
    gradients into the new scale, so the next batch accumulates onto them in one scale. The clip never binds: the
    weights are those of the run without it, bitwise (power-of-two scales), with one update per batch instead of per
    step."""
    clipped, plain = ClipsEveryBatchStepsEveryOther(clip=True), ClipsEveryBatchStepsEveryOther(clip=False)
    trainers = [_fit_quietly(model) for model in (clipped, plain)]
    _assert_same_params(clipped, plain)
    assert [t.precision_plugin._recipe.updates for t in trainers] == [4, 2]


def test_unscaled_gradients_cleared_before_the_next_backward_are_fine():
    model = ClipsEveryBatchStepsEveryOther(zero_before_next_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    _fit_quietly(model)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


class ClipsBetweenTwoBackwards(TwoStepsPerBatch):
    """Two backwards in one ``training_step`` and a clip between them, one step after both."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.loss(batch))
        self.clip_gradients(opt, gradient_clip_val=1e9, gradient_clip_algorithm="value")
        self.manual_backward(self.layer(batch).float().mean())
        opt.step()


def test_a_backward_onto_gradients_unscaled_in_the_same_step_is_refused():
    """Within one iteration nothing owes an update between the clip and the second backward: its scaled gradients would
    meet the unscaled ones (torch's own loop steps on the mix silently). That backward raises, naming what to do."""
    model = ClipsBetweenTwoBackwards()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"Step SGD before the next backward .* mix two scales"):
        _fit_quietly(model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


class SkipsSomeBatches(TinyModule):
    """Automatic optimization with clipping; ``training_step`` returns None on odd batches (no backward, no step)."""

    samples, data_seed = 8, 1

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else self.loss(batch)


def test_clipping_on_a_batch_without_backward_leaves_no_state():
    """Clipping runs on a batch whose ``training_step`` returned None; the scaler must not carry that empty unscale into
    the next batch, where torch would fail with "No inf checks were recorded for this optimizer")."""
    model, reference = _twins(SkipsSomeBatches)
    trainer = _fit_quietly(model, gradient_clip_val=1e9, gradient_clip_algorithm="norm")
    # the recipe: only the even batches train, one update each
    scaler = new_scaler(init_scale=LOW_INIT_SCALE)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    for batch_idx, batch in enumerate(reference.train_dataloader()):
        if batch_idx % 2:
            continue
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference.loss(batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()
    _assert_same_params(model, reference)


class TwoOptimizers(TwoStepsPerBatch):
    """A layer and a head, each with its own optimizer: the update is due only once both stepped, or at the batch's
    end."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)

    def loss(self, batch):
        return self.head(self.layer(batch)).float().pow(2).mean()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.layer.parameters(), lr=0.01), torch.optim.SGD(self.head.parameters(), lr=0.01)]


class RaisesAfterTheFirstStep(TwoOptimizers):
    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        self.manual_backward(self.loss(batch))
        first.step()
        if batch_idx == 1:
            raise ValueError("the user's own error, after the first step")
        second.step()
        first.zero_grad()
        second.zero_grad()


def test_an_exception_ends_the_iteration_and_keeps_its_update(tmp_path):
    """An exception after the first optimizer's step, caught around ``fit``, then ``save_checkpoint``: the iteration's
    update is applied when the exception leaves the batch, so the checkpoint holds the scale the run goes on with
    (stock updates right after each step: the same here)."""
    trainer = _trainer()
    with pytest.raises(ValueError, match="the user's own error"):
        trainer.fit(RaisesAfterTheFirstStep())
    plugin = trainer.precision_plugin
    assert plugin.scaler.get_scale() == 2.0**6  # two batches stepped, two updates
    assert not plugin._recipe.update_owed
    checkpoint = tmp_path / "after.ckpt"
    trainer.save_checkpoint(checkpoint)
    assert torch.load(checkpoint, weights_only=False)["MixedPrecision"] == plugin.scaler.state_dict()


class StepsAtEpochEnd(TwoOptimizers):
    """Full-epoch accumulation: every batch's backward accumulates, the one step is in ``on_train_epoch_end``; the
    head's optimizer does not step there, so the update is not due right after that step."""

    def training_step(self, batch, batch_idx):
        self.manual_backward(self.loss(batch))

    def on_train_epoch_end(self):
        opt, _ = self.optimizers()
        opt.step()
        opt.zero_grad()


def test_a_step_in_on_train_epoch_end_gets_its_update_when_training_ends():
    trainer = _fit_quietly(StepsAtEpochEnd())
    # the recipe: accumulate over the epoch, step, update
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**5
    assert not trainer.precision_plugin._recipe.update_owed


class ClosureThenPlainStep(TinyModule):
    """Automatic optimization with an ``optimizer_step`` override that runs the closure, then steps without it."""

    data_seed = 3

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer_closure()
        optimizer.step()


def test_an_optimizer_step_override_that_runs_the_closure_itself_steps():
    """Stock Lightning takes no step here under 16-mixed, silently (the plugin reads the closure's missing result as
    "no backward"); with 32-bit precision the same override steps. So does the fork, as the recipe does."""
    model, reference = _twins(ClosureThenPlainStep)
    trainer = _fit_quietly(model)
    scaler = new_scaler(init_scale=LOW_INIT_SCALE)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    for batch in reference.train_dataloader():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference.training_step(batch, 0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale() == 2.0**7
    _assert_same_params(model, reference)


class ReadsTheSkipFromTheScale(TinyModule):
    """The common idiom: ``scale = scaler.get_scale(); opt.step(); skipped = scaler.get_scale() < scale``, in manual
    optimization and in an ``optimizer_step`` override of automatic optimization."""

    def __init__(self, automatic: bool) -> None:
        super().__init__()
        self.automatic_optimization = automatic
        self.skipped = []

    def _loss(self, batch, batch_idx):
        return self.loss(batch) * (float("inf") if batch_idx == 1 else 1)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self._loss(batch, batch_idx)
        opt = self.optimizers()
        scaler = self.trainer.precision_plugin.scaler
        self.manual_backward(self._loss(batch, batch_idx))
        scale = scaler.get_scale()
        opt.step()
        self.skipped.append(scaler.get_scale() < scale)
        opt.zero_grad()
        return None

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        scaler = self.trainer.precision_plugin.scaler
        scale = scaler.get_scale()
        optimizer.step(closure=optimizer_closure)
        self.skipped.append(scaler.get_scale() < scale)


@pytest.mark.parametrize("automatic", [False, True])
def test_the_scale_after_the_step_says_whether_it_was_skipped(automatic):
    """With one optimizer, its step is the iteration's last: the update follows it at once, as in PyTorch's recipe, so
    the scale read right after the step shows the skip."""
    model = ReadsTheSkipFromTheScale(automatic)
    _fit_quietly(model)
    assert model.skipped == [False, True, False]


class TwoSurgeryCyclesPerBatch(TinyModule):
    """Gradient surgery twice per batch: ``torch.autograd.grad`` of the scaled loss of each half, assigned to ``.grad``,
    then ``scaler.unscale_(opt)`` (PyTorch's recipe: the plugin cannot see a backward it did not run, so after a step in
    the same ``training_step`` it takes the gradients for the ones that step used), ``clip_gradients`` and the step."""

    lr, data_seed, automatic = 0.1, 5, False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        scaler = self.trainer.precision_plugin.scaler
        params = list(self.layer.parameters())
        for half in (batch[:1], batch[1:]):
            grads = torch.autograd.grad(scaler.scale(self.loss(half)), params)
            for p, g in zip(params, grads):
                p.grad = g
            scaler.unscale_(opt)
            self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


def test_a_second_step_cycle_in_a_batch_clips_unscaled_gradients():
    """The second cycle's gradients, assigned after the first step and unscaled by the user, are clipped as the recipe
    clips them (torch's scaler needs an update between two steps of one optimizer: the recipe updates after each)."""
    model, reference = _twins(TwoSurgeryCyclesPerBatch)
    trainer = _fit_quietly(model)
    scaler = new_scaler(init_scale=LOW_INIT_SCALE)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    params = list(reference.layer.parameters())
    norms = []  # what clipping saw
    for batch in reference.train_dataloader():
        for half in (batch[:1], batch[1:]):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = reference.loss(half)
            grads = torch.autograd.grad(scaler.scale(loss), params)
            for p, g in zip(params, grads):
                p.grad = g
            scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.01)))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert 0.01 < min(norms) < max(norms) < 10  # every clip clips, and unscaled gradients (the scale is 2**4 and up)
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()
    _assert_same_params(model, reference)


class TogglesTwoOptimizers(TinyModule):
    """A GAN's manual optimization: each network clipped after its own backward, with ``toggle_optimizer``, then both
    stepped. The generator's backward runs while the discriminator's gradients are unscaled, not yet stepped, and out
    of its reach (toggled off)."""

    automatic, data_seed = False, 1

    def __init__(self) -> None:
        super().__init__()
        del self.layer
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(4, 4), nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        opt_d, opt_g = self.optimizers()
        self.toggle_optimizer(opt_d)
        self.manual_backward(self.d(self.g(batch).detach()).float().pow(2).mean())
        self.clip_gradients(opt_d, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        self.manual_backward(-self.d(self.g(batch)).float().mean())
        self.clip_gradients(opt_g, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        self.untoggle_optimizer(opt_g)
        opt_d.step()
        opt_g.step()
        opt_d.zero_grad()
        opt_g.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.d.parameters(), lr=0.1), torch.optim.SGD(self.g.parameters(), lr=0.1)]


def test_a_gan_that_clips_each_network_after_its_own_backward_equals_the_recipe():
    model, reference = _twins(TogglesTwoOptimizers)
    g, d = reference.g, reference.d
    _fit_quietly(model)
    opt_d, opt_g = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
    scaler = new_scaler(init_scale=LOW_INIT_SCALE)
    for batch in model.train_dataloader():
        with torch.autocast("cpu", dtype=torch.float16):
            loss_d = d(g(batch).detach()).float().pow(2).mean()
        scaler.scale(loss_d).backward()
        scaler.unscale_(opt_d)
        torch.nn.utils.clip_grad_norm_(d.parameters(), 0.01)
        d.requires_grad_(False)  # what toggle_optimizer(opt_g) does
        with torch.autocast("cpu", dtype=torch.float16):
            loss_g = -d(g(batch)).float().mean()
        scaler.scale(loss_g).backward()
        d.requires_grad_(True)
        scaler.unscale_(opt_g)
        torch.nn.utils.clip_grad_norm_(g.parameters(), 0.01)
        scaler.step(opt_d)
        scaler.step(opt_g)
        scaler.update()
        opt_d.zero_grad()
        opt_g.zero_grad()
    _assert_same_params(model, reference)


def test_a_plugin_driven_without_declared_optimizers_updates_after_each_step():
    """Used on its own (no Trainer declared the fit's optimizers, as in upstream's unit tests of the plugin), each step
    is its own step cycle: the update follows it, as in stock Lightning."""
    plugin = _plugin()
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    for _ in range(2):
        plugin._recipe.scale(param.sum()).backward()
        plugin._recipe.step(optimizer)
        optimizer.zero_grad()
    assert plugin.scaler.get_scale() == 2.0**6  # growth_interval=1: two updates


class UnscalesItselfWithoutStepping(TwoStepsPerBatch):
    """The user's own ``scaler.unscale_(opt)`` and clipping on a batch that does not step (a non-finite guard)."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        self.trainer.precision_plugin.scaler.unscale_(opt.optimizer)
        torch.nn.utils.clip_grad_norm_(self.layer.parameters(), 1e9)
        opt.zero_grad()  # no step: PyTorch's recipe still calls `scaler.update()`, which the inf check owes


def test_the_users_own_unscale_owes_the_update_at_the_batch_end():
    trainer = _fit_quietly(UnscalesItselfWithoutStepping())
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**4 * 2**3  # one update per batch, three batches


class RaisesBetweenTwoSteps(TwoStepsPerBatch):
    """Two optimizers fed by one backward; the second batch raises after the first optimizer's step."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward((self.second(self.first(batch))).float().pow(2).mean())
        first.step()
        if batch_idx == 1:
            raise ValueError("after the first step")
        second.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.first.parameters(), lr=0.01), torch.optim.SGD(self.second.parameters(), lr=0.01)


def test_an_exception_leaving_the_batch_applies_the_update_its_step_owes():
    """The batch is left by an exception after the first optimizer's step: the update that step owes is applied as
    the batch is left, before the ``on_exception`` callbacks see the scaler (a checkpoint saved there resumes with
    it)."""

    class ScaleOnException(Callback):
        def on_exception(self, trainer, *_):
            self.scale = trainer.precision_plugin.scaler.get_scale()
            self.saved = trainer.precision_plugin.state_dict()["scale"]

    record = ScaleOnException()
    with pytest.raises(ValueError, match="after the first step"):
        _fit_quietly(RaisesBetweenTwoSteps(), callbacks=[record])
    # batch 0: one update after both steps; batch 1: the update the first step owes, as the batch is left
    assert record.scale == record.saved == 2.0**4 * 2**2


def test_unscale_gradients_unscales_once_per_update_whoever_asks_first():
    """``MixedPrecision.unscale_gradients`` (what upstream's loops and callbacks call) unscales once per update: a
    second call, or one after the user's own ``scaler.unscale_(optimizer)``, changes nothing."""
    plugin = _plugin()
    layer = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    plugin._recipe.scale(layer(torch.ones(1, 2)).sum()).backward()
    grad = layer.weight.grad.clone()
    plugin.unscale_gradients(optimizer)
    plugin.unscale_gradients(optimizer)
    assert torch.equal(layer.weight.grad, grad / 2.0**4)
    plugin._recipe.step(optimizer)  # the update follows (no declared optimizers)
    optimizer.zero_grad()
    plugin._recipe.scale(layer(torch.ones(1, 2)).sum()).backward()
    grad = layer.weight.grad.clone()
    plugin.scaler.unscale_(optimizer)
    plugin.unscale_gradients(optimizer)
    assert torch.equal(layer.weight.grad, grad / plugin.scaler.get_scale())


def test_clipping_an_optimizer_without_gradients_leaves_nothing_for_its_next_step():
    """Clipping an optimizer none of whose parameters has a gradient (its network sat this backward out) unscales
    nothing: torch would keep an entry without an inf check, which its next update and step refuse."""
    plugin = _plugin()
    layer, other = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    plugin._recipe.scale(other(torch.ones(1, 2)).sum()).backward()  # scaled, not reaching `layer`
    plugin.clip_gradients(optimizer, clip_val=1.0)
    plugin._recipe.scale(layer(torch.ones(1, 2)).sum()).backward()
    plugin._recipe.step(optimizer)  # through the scaler; the update follows (no declared optimizers)
    assert plugin.scaler.get_scale() == 2.0**5
