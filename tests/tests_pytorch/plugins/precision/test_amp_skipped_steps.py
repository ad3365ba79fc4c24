"""Skipped steps under 16-mixed are visible, and step-interval LR schedulers do not advance on them (promise 7).

The fork tells whether an optimizer's last step was skipped (``LightningOptimizer.step_was_skipped``, answered by
``Precision.optimizer_step_was_skipped``), and in automatic optimization an ``interval="step"`` scheduler stays put on
such a step. Overflows are forced (``inf`` in the loss of chosen batches) from a small power-of-two scale with
``growth_interval=1``; the reference is PyTorch's AMP recipe (:func:`recipe_run`), its scheduler stepped only when the
update did not back off, equal bitwise (parameters, LR and scale). Stock 2.6.6, the negative control, advances the
scheduler on skipped steps. ``global_step``, ``max_steps`` and ``every_n_train_steps`` count step calls, skipped or not.
"""

import functools
import math
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from amp_oracle.run import Run, assert_same_run
from amp_oracle.torch_features import optimizer
from amp_oracle.trainer import STOCK, lightning_api, make_trainer, quiet_trainer
from amp_oracle.world import (
    AUTOCAST_CACHE,
    LOW_INIT_SCALE,
    TRAINER_BATCHES,
    Batches,
    inject_inf,
    mlp,
    mlp_loss,
    new_scaler,
)
from amp_oracle.world import trainer_batches as make_batches
from torch.optim.lr_scheduler import LambdaLR, StepLR

#: batches whose loss is multiplied by ``inf``: the very first step (normal at the start of fp16 training, and the case
#: where PyTorch warns about a scheduler stepped before its optimizer) and two in a row
FORCED = (0, 3, 4)
MODES = ("automatic", "manual")

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "SGD-fused": lambda params: optimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9, fused=True),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "AdamW-fused": lambda params: optimizer(torch.optim.AdamW, params, lr=1e-2, fused=True),
}
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda opt: StepLR(opt, step_size=1, gamma=0.5),
    "LambdaLR": lambda opt: LambdaLR(opt, lambda n: 1.0 / (1 + n)),
}
#: PyTorch's warning when a scheduler steps before its optimizer ever stepped (a skipped first step)
SCHEDULER_BEFORE_OPTIMIZER = "lr_scheduler.step()` before `optimizer.step()`"


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_trainer():
        yield


def new_run() -> Run:
    """An empty :class:`~amp_oracle.run.Run` filled batch by batch: ``skipped`` is ``step_was_skipped`` read after
    each batch's step (the recipe: whether the update backed off), ``records`` the learning rate after each batch."""
    return Run(params={}, scales=[], changed=[], skipped=[])


# ----------------------------------------------------------------------------------------------------------------------
# the recipe
# ----------------------------------------------------------------------------------------------------------------------


def recipe_run(
    optimizer: str, scheduler: Optional[str], forced=FORCED, n_batches: int = TRAINER_BATCHES, accumulate: int = 1
) -> Run:
    """PyTorch's AMP recipe; the scheduler steps only after an applied optimizer step."""
    net = mlp()
    opt = OPTIMIZERS[optimizer](net.parameters())
    sch = SCHEDULERS[scheduler](opt) if scheduler else None
    scaler = new_scaler(init_scale=LOW_INIT_SCALE)
    if optimizer == "SGD-fused":
        # torch leaves fused SGD's momentum buffers uninitialised when the scaler skips its first step (FORCED does),
        # and the weights then blow up; a careful hand-written loop gives them zeros first, as the fork does (zeros
        # are exactly for-loop SGD's first step with dampening=0)
        for p in net.parameters():
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    run = new_run()
    last_skipped = False
    for i, (x, y) in enumerate(make_batches()[:n_batches]):
        before = [p.detach().clone() for p in net.parameters()]
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=AUTOCAST_CACHE):
            loss = inject_inf(mlp_loss(net, x, y), i, forced)
        scaler.scale(loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            scaler.step(opt)
            scale = scaler.get_scale()
            scaler.update()
            last_skipped = scaler.get_scale() < scale  # growth_interval=1: the scale halves exactly on a skip
            if sch is not None and not last_skipped:
                sch.step()
            opt.zero_grad(set_to_none=True)
        run.skipped.append(last_skipped)
        run.records.append(opt.param_groups[0]["lr"])
        run.scales.append(scaler.get_scale())
        run.changed.append(any(not torch.equal(b, p) for b, p in zip(before, net.parameters())))
    run.params = {f"net.{n}": p.detach().clone() for n, p in net.named_parameters()}
    return run


@functools.cache
def cached_recipe(optimizer: str, scheduler: Optional[str], forced=FORCED, accumulate: int = 1) -> Run:
    run = recipe_run(optimizer, scheduler, forced, accumulate=accumulate)
    # the recipe is sharp: exactly the forced steps were skipped, all others applied
    steps = [i for i in range(TRAINER_BATCHES) if (i + 1) % accumulate == 0]
    overflowed = [i for i in steps if any(j in forced for j in range(i + 1 - accumulate, i + 1))]
    assert [i for i in steps if run.skipped[i]] == overflowed
    return run


# ----------------------------------------------------------------------------------------------------------------------
# the Lightning side
# ----------------------------------------------------------------------------------------------------------------------


def new_module(package: str, optimizer: str, scheduler: Optional[str], automatic: bool, forced=FORCED, none_at=()):
    """The oracle's ``RecipeModule`` around ``mlp()``: ``inf`` in the loss of ``forced`` batches, ``None`` returned by
    the ``training_step`` of ``none_at`` batches (automatic only). Manual optimization follows the documented pattern
    ``opt.step(); if not opt.step_was_skipped: scheduler.step()`` and records ``step_was_skipped`` before the first
    step (``read_before_first_step``) and right after every step (``records``)."""

    def training_step(self, batch, batch_idx):
        if batch_idx in none_at:
            return None
        loss = inject_inf(mlp_loss(self.net, *batch), batch_idx, forced)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        if batch_idx == 0:
            self.read_before_first_step = opt.step_was_skipped
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.records.append(opt.step_was_skipped)
        if scheduler and not opt.step_was_skipped:
            self.lr_schedulers().step()
        return None

    def configure(net):
        opt = OPTIMIZERS[optimizer](net.parameters())
        if not scheduler:
            return [opt]
        return [{"optimizer": opt, "lr_scheduler": {"scheduler": SCHEDULERS[scheduler](opt), "interval": "step"}}]

    return lightning_api(package).RecipeModule(mlp(), configure, training_step, automatic, "16-mixed")


@functools.cache
def recorder_class(package: str) -> type:
    pl = lightning_api(package).pl

    class Record(pl.Callback):
        """Reads the skip signal in ``on_train_batch_end`` through both public handles on the optimizer."""

        def __init__(self) -> None:
            self.run = new_run()
            self.via_strategy: list[bool] = []
            self._before: list[torch.Tensor] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._before = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            run = self.run
            if hasattr(pl_module.optimizers(), "step_was_skipped"):  # the stock negative control has no signal
                run.skipped.append(pl_module.optimizers().step_was_skipped)
                self.via_strategy.append(trainer.strategy._lightning_optimizers[0].step_was_skipped)
            run.records.append(trainer.optimizers[0].param_groups[0]["lr"])
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            run.scales.append(scaler.get_scale() if scaler is not None else None)
            run.changed.append(any(not torch.equal(b, p) for b, p in zip(self._before, pl_module.parameters())))

        def on_train_end(self, trainer, pl_module):
            self.run.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    return Record


def fit(package: str, module, precision: str = "16-mixed", callbacks=(), **kwargs: Any):
    record = recorder_class(package)()
    scaler = new_scaler(init_scale=LOW_INIT_SCALE) if precision == "16-mixed" else None
    trainer = make_trainer(lightning_api(package), precision, scaler=scaler, callbacks=[record, *callbacks], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=Batches())
    record.warnings = [str(w.message) for w in caught]
    return trainer, record


# ----------------------------------------------------------------------------------------------------------------------
# the skip signal
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_step_was_skipped_exactly_on_forced_overflows(mode, optimizer):
    module = new_module("lightning", optimizer, None, automatic=mode == "automatic")
    _, record = fit("lightning", module)
    expected = [i in FORCED for i in range(TRAINER_BATCHES)]

    assert record.run.skipped == expected  # `pl_module.optimizers().step_was_skipped` in `on_train_batch_end`
    assert record.via_strategy == expected  # the strategy's `LightningOptimizer`, the same object
    if mode == "manual":
        assert module.records == expected  # read right after `opt.step()` in `training_step`
        assert module.read_before_first_step is False  # no step yet: nothing was skipped
    # the signal agrees with what happened: untouched weights and a backed-off scale exactly on the skipped steps
    assert record.run.changed == [not s for s in expected]
    recipe = cached_recipe(optimizer, None)
    assert_same_run(record.run, recipe, records=True)


def test_stock_lightning_has_no_skip_signal():
    """Negative control: the unpatched ``stock_pytorch_lightning`` 2.6.6 offers no way to know."""
    pl = lightning_api(STOCK).pl
    assert not hasattr(pl.core.optimizer.LightningOptimizer, "step_was_skipped")
    assert not hasattr(pl.plugins.precision.Precision, "optimizer_step_was_skipped")


@pytest.mark.parametrize("optimizer", ["AdamW", "AdamW-fused"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_step_was_skipped_is_false_without_a_scaler(precision, mode, optimizer):
    """Without a scaler nothing is ever skipped, not even a step with non-finite gradients: it is applied."""
    last = TRAINER_BATCHES - 1
    module = new_module("lightning", optimizer, None, automatic=mode == "automatic", forced=(last,))
    trainer, record = fit("lightning", module, precision=precision)
    assert trainer.precision_plugin.optimizer_step_was_skipped(trainer.optimizers[0]) is False
    assert record.run.skipped == [False] * TRAINER_BATCHES
    assert record.via_strategy == [False] * TRAINER_BATCHES
    if mode == "manual":
        assert module.records == [False] * TRAINER_BATCHES
    assert all(record.run.changed)
    assert not all(torch.isfinite(p).all() for p in record.run.params.values()), "the inf step was applied"


# ----------------------------------------------------------------------------------------------------------------------
# schedulers
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW", "AdamW-fused"])
@pytest.mark.parametrize("mode", MODES)
def test_step_scheduler_follows_the_recipe(mode, optimizer, scheduler):
    """Automatic: the Trainer leaves an ``interval="step"`` scheduler alone on a skipped step, fused optimizers included
    (whose skip, decided in their kernel, costs one device read per step to ask). Manual: the documented
    ``if not opt.step_was_skipped: scheduler.step()``. Both equal the recipe bitwise: LR, scale, parameters."""
    module = new_module("lightning", optimizer, scheduler, automatic=mode == "automatic")
    trainer, record = fit("lightning", module)
    recipe = cached_recipe(optimizer, scheduler)
    assert_same_run(record.run, recipe, records=True)
    # the scheduler stepped once per applied step, and the first (skipped) step did not make PyTorch warn
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == TRAINER_BATCHES - len(FORCED)
    assert not [w for w in record.warnings if SCHEDULER_BEFORE_OPTIMIZER in w]


def test_step_scheduler_with_gradient_accumulation():
    """The step at the end of an accumulation window is skipped when any of its micro-batches overflowed."""
    forced = (1, 4)  # the first micro-batch of the first window, the second of the third window
    module = new_module("lightning", "AdamW", "StepLR", automatic=True, forced=forced)
    _, record = fit("lightning", module, accumulate_grad_batches=2)
    recipe = cached_recipe("AdamW", "StepLR", forced, accumulate=2)
    # Lightning divides the loss by the window size before scaling it, as the recipe does
    assert record.run.records == recipe.records
    assert record.run.scales == recipe.scales
    assert record.run.changed == recipe.changed
    assert record.run.skipped == recipe.skipped == [False, True, True, False, False, True, True, False]
    assert all(torch.equal(record.run.params[n], p) for n, p in recipe.params.items())


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_stock_lightning_advances_the_scheduler_on_skipped_steps(scheduler):
    """Negative control: the unpatched ``stock_pytorch_lightning`` 2.6.6 steps the scheduler on every batch, skipped or
    not, so its LR runs ahead of the weights (and PyTorch warns on the skipped first step)."""
    module = new_module(STOCK, "AdamW", scheduler, automatic=True)
    trainer, record = fit(STOCK, module)
    recipe = cached_recipe("AdamW", scheduler)
    assert record.run.scales == recipe.scales  # the same steps were skipped ...
    assert record.run.changed == recipe.changed
    assert record.run.records != recipe.records  # ... but the LR moved on anyway
    advancing = [SCHEDULERS[scheduler](torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-2))]
    every_batch = []
    for _ in range(TRAINER_BATCHES):
        advancing[0].step()
        every_batch.append(advancing[0].get_last_lr()[0])
    assert record.run.records == every_batch
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == TRAINER_BATCHES
    assert [w for w in record.warnings if SCHEDULER_BEFORE_OPTIMIZER in w]


def test_scheduler_on_a_batch_without_step_does_not_depend_on_the_previous_batch():
    """A ``training_step`` that returns ``None`` makes no optimizer step. Whether the step scheduler advances on that
    batch is a decision (stock: it advances); it must not depend on whether the *previous* batch's step was skipped.
    Measured: after an applied step the scheduler advances on the ``None`` batch, after a skipped one it does not."""

    def advanced_on_batch_2(forced):
        module = new_module("lightning", "SGD", "StepLR", automatic=True, forced=forced, none_at=(2,))
        _, record = fit("lightning", module)
        assert record.run.changed[2] is False  # no step on batch 2
        return record.run.records[2] != record.run.records[1]

    assert advanced_on_batch_2(forced=(1,)) == advanced_on_batch_2(forced=())


# ----------------------------------------------------------------------------------------------------------------------
# global_step, max_steps, ModelCheckpoint(every_n_train_steps): count step calls, skipped or not
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_global_step_and_max_steps_count_skipped_steps(mode):
    forced = (1, 3)
    module = new_module("lightning", "AdamW", "StepLR", automatic=mode == "automatic", forced=forced)
    trainer, record = fit("lightning", module, max_steps=6)
    assert trainer.global_step == 6  # six optimizer step calls ...
    assert len(record.run.changed) == 6  # ... in six batches, after which max_steps stopped the run
    assert sum(record.run.changed) == 4  # of which four were applied
    assert record.run.skipped == [i in forced for i in range(6)]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4  # and the scheduler followed the applied ones


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_cadence_does_not_depend_on_skipped_steps(mode, tmp_path):
    api = lightning_api("lightning")
    saved = {}
    for forced in ((), (1, 3)):
        dirpath = tmp_path / f"forced{len(forced)}"
        checkpoint = api.pl.callbacks.ModelCheckpoint(
            dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=-1
        )
        module = new_module("lightning", "AdamW", "StepLR", automatic=mode == "automatic", forced=forced)
        fit("lightning", module, max_steps=6, callbacks=[checkpoint], enable_checkpointing=True)
        saved[forced] = sorted(p.name for p in dirpath.iterdir())
    assert saved[()] == saved[(1, 3)] == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]


def test_recipe_scale_halves_exactly_on_skips():
    """Self-check of the reference: ``growth_interval=1`` makes the scale a faithful record of skips."""
    run = cached_recipe("AdamW", "StepLR")
    trajectory = [LOW_INIT_SCALE] + run.scales
    assert [b / a for a, b in zip(trajectory, trajectory[1:])] == [0.5 if s else 2.0 for s in run.skipped]
    assert all(math.log2(s).is_integer() for s in run.scales)
