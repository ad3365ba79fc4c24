"""The scenario table: mixed-precision usage patterns run through PyTorch's AMP recipe, the fork and stock 2.6.6.

A :class:`Scenario` is one thing a user does in a ``LightningModule``, written twice: ``step``, the ``training_step``
body ``(module, batch, batch_idx)``, and ``recipe``, the same training as a hand-written AMP loop ``(RecipeRun,
optimizers)`` (:mod:`amp_oracle.loops`). :func:`lightning_outcome` trains it through the Trainer of a package and
returns the run, or the exception and whether the weights and optimizer states were those of the last ``mark()`` (the
batch's start); :func:`recipe_outcome` trains the recipe; :func:`assert_outcome` judges a run by what the scenario
expects: :data:`EQUAL`, :class:`Raises`, :class:`EqualOrRaises` (the fork may refuse a pattern or support it, never
train silently wrong), and for stock :class:`Differs` (the negative control), :data:`NO_ERROR` or :data:`MISSING`.

The data are a function of ``batch_idx`` (the loader yields positions) so that a run resumed mid-epoch trains on the
uninterrupted run's batches (Lightning restarts a non-resumable loader while ``batch_idx`` continues).
"""

import contextlib
import copy
import functools
import math
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from amp_oracle.loops import (
    auto_plain,
    manual_clip,
    manual_closure,
    manual_gan,
    manual_gan_step,
    manual_multi_step,
    manual_one_optimizer,
    manual_two_optimizers,
    recipe_accumulate,
    recipe_clip,
    recipe_gan,
    recipe_multi_step,
    recipe_one_optimizer,
    recipe_plain,
    recipe_two_optimizers,
)
from amp_oracle.run import RecipeRun, Run, assert_same_run
from amp_oracle.torch_features import (
    cpu_grad_scaler,
    cuda_grad_scaler,
    optimizer,
    require_cpu_16_mixed,
    require_cpu_fp16_autocast,
)
from amp_oracle.trainer import lightning_api, make_trainer
from amp_oracle.world import (
    AUTOCAST_CACHE,
    CLIP_NORM,
    GAN,
    INF_BATCH,
    INIT_SCALE,
    MIXED_PRECISIONS,
    OUT_FEATURES,
    PRECISIONS,
    TRAINER_BATCHES,
    Positions,
    clip_args,
    gan_optimizers,
    inject_inf,
    make_optimizer,
    mlp,
    mlp_loss,
    new_scaler,
    one_optimizer,
    optimizer_params,
    same,
    snapshot,
    trainable,
    trainer_batches,
    two_optimizers,
)

P16 = ("16-mixed",)

# --------------------------------------------------------------------------------------------------------------------
# what a scenario expects
# --------------------------------------------------------------------------------------------------------------------

#: the run is the recipe's, bitwise
EQUAL = "equal"
#: stock trains without raising (where the fork must raise; nothing to compare with)
NO_ERROR = "no error"
#: stock has no such feature: not run
MISSING = "missing"


@dataclass(frozen=True)
class Raises:
    types: tuple[type, ...]
    #: ``re.search`` pattern the message must match
    match: str
    #: a pattern the message must not match (the error must not be rewritten into something else)
    not_match: Optional[str] = None
    #: a pattern the message of ``__cause__`` must match (the original error is kept)
    cause: Optional[str] = None
    #: no ``training_step`` ran (a configuration error found before training)
    before_training: bool = False
    #: the weights and optimizer states are as at the last mark
    unchanged: bool = True


@dataclass(frozen=True)
class EqualOrRaises:
    raises: Raises


@dataclass(frozen=True)
class Differs:
    """Stock does not follow the recipe; ``what`` is in the comparison's message (``parameters differ``, ``scale
    trajectory``, ``changed per batch``, ``records``)."""

    what: str = ""


#: the errors a scenario may expect from the fork for misuse: what the contract calls a clear error
CLEAR_ERRORS = (RuntimeError, ValueError)


# --------------------------------------------------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------------------------------------------------

#: the batch during which a saving scenario saves its checkpoint
SAVE_AT = 3
#: the batch Lightning's loop runs first when resuming from a checkpoint saved during batch SAVE_AT: the interrupted
#: batch counts as not completed, so it runs again (its first optimizer steps a second time)
RESUME_START = SAVE_AT


@dataclass(frozen=True)
class Scenario:
    name: str
    #: what it covers (a usage pattern)
    about: str
    #: ``training_step`` body ``(module, batch, batch_idx)``
    step: Callable
    #: the recipe ``(RecipeRun, optimizers)``; ``None``: nothing to compare with (only errors are expected)
    recipe: Optional[Callable]
    precisions: tuple[str, ...] = MIXED_PRECISIONS
    #: the fork's expected outcome: one for all precisions, or ``{precision: outcome}``
    expect: Any = EQUAL
    #: stock's outcome, the same way (found by running it; see the module docstring for the kinds)
    stock: Any = EQUAL
    net: Callable[[], nn.Module] = mlp
    configure: Callable[[nn.Module], list] = functools.partial(one_optimizer, name="SGD")
    #: LR schedulers for the optimizers (``optimizers -> schedulers``), returned by ``configure_optimizers`` too
    schedulers: Optional[Callable[[list], list]] = None
    automatic: bool = False
    #: extra Trainer arguments, or a function ``(api) -> dict`` of them (callbacks go under ``"callbacks"``)
    trainer: Union[dict, Callable[[Any], dict]] = field(default_factory=dict)
    #: the LightningModule's ``on_train_epoch_end(module)``
    epoch_end: Optional[Callable] = None
    #: a callback ``{hook name: fn(trainer, module, *args)}``
    callback: dict[str, Callable] = field(default_factory=dict)
    #: the 16-mixed scaler (default :func:`new_scaler`)
    scaler: Optional[Callable[[], Any]] = None
    init_scale: float = INIT_SCALE
    #: batches per epoch and epochs
    batches: int = TRAINER_BATCHES
    epochs: int = 1
    #: a checkpoint is saved during batch :data:`SAVE_AT` (``module.save_point``, the recipe's ``rc.save_point``)
    saves: bool = False
    #: the saving scenario whose checkpoint this one resumes from (``fit(ckpt_path=...)``)
    resume: Optional[str] = None
    #: compare what both sides recorded (off where only one side records, e.g. the recipe's clip sizes)
    records: bool = True
    #: a check that the recipe run exercised what the scenario is about (``Run -> bool``)
    sharp: Optional[Callable[[Run], bool]] = None
    #: the fork's opt-in misuse watch (``MixedPrecision(..., watch_misuse=True)``); stock has none
    watch_misuse: bool = False

    def expected(self, precision: str, stock: bool = False) -> Any:
        outcome = self.stock if stock else self.expect
        return outcome[precision] if isinstance(outcome, dict) else outcome

    def cells(self) -> list[str]:
        return [f"{self.name}:{precision}" for precision in self.precisions]


def save_and_resume(
    where: str, about: str, *, stock: Any = EQUAL, resume_stock: Any, **kwargs: Any
) -> tuple[Scenario, ...]:
    """The pair ``checkpoint_<where>`` (saves a checkpoint during batch :data:`SAVE_AT` and must train on as the
    recipe does) and ``resume_from_checkpoint_<where>`` (resumes from that checkpoint and must continue as the recipe
    restored from its snapshot of the same moment, from batch :data:`RESUME_START`), under 16-mixed."""
    saving = Scenario(f"checkpoint_{where}", about, precisions=P16, stock=stock, saves=True, **kwargs)
    about = "... and resumes exactly where Lightning's loop continues (it re-runs the batch)"
    return saving, replace(
        saving, name=f"resume_from_{saving.name}", about=about, stock=resume_stock, saves=False, resume=saving.name
    )


# --------------------------------------------------------------------------------------------------------------------
# the two sides' machinery
# --------------------------------------------------------------------------------------------------------------------


def _optimizer_states(optimizers: list) -> list:
    return [copy.deepcopy(opt.state_dict()["state"]) for opt in optimizers]


@dataclass
class Outcome:
    run: Optional[Run] = None
    error: Optional[BaseException] = None
    #: the weights and optimizer states at the error were those of the last mark
    unchanged: Optional[bool] = None
    #: training steps that ran
    steps: int = 0


class ScenarioRecipe(RecipeRun):
    """A scenario's :class:`RecipeRun` (the fork's autocast cache policy: on in automatic optimization where torch makes
    it safe, off in manual) that snapshots its state at the save point and can be restored from one; a resumed run
    records the batches it trains, as the Lightning side does."""

    def __init__(self, scenario: Scenario, precision: str) -> None:
        cache = AUTOCAST_CACHE and scenario.automatic
        super().__init__(scenario.net(), precision, cache, init_scale=scenario.init_scale)
        self.stop = scenario.batches
        self.scenario = scenario
        self.snapshot: Optional[dict] = None

    def batches(self):
        for batch_idx, batch in super().batches():
            if self.scenario.resume is not None:
                self.records.append(("batch", batch_idx))
            yield batch_idx, batch

    def save_point(self, batch_idx: int, optimizers: list) -> None:
        """The recipe's counterpart of ``trainer.save_checkpoint`` at this point of batch ``batch_idx``."""
        if self.scenario.saves and batch_idx == SAVE_AT:
            self.snapshot = copy.deepcopy({
                "net": self.net.state_dict(),
                "optimizers": [opt.state_dict() for opt in optimizers],
                "scaler": self.scaler.state_dict(),
            })

    def restore(self, saved: Optional[dict], optimizers: list) -> None:
        assert saved is not None, "the recipe never reached the save point"
        self.net.load_state_dict(saved["net"])
        self.scaler.load_state_dict(saved["scaler"])
        for opt, state in zip(optimizers, saved["optimizers"]):
            opt.load_state_dict(state)
        self.start = RESUME_START


@functools.cache
def _recipe(name: str, precision: str) -> ScenarioRecipe:
    scenario = SCENARIOS[name]
    rc = ScenarioRecipe(scenario, precision)
    opts = scenario.configure(rc.net)
    if scenario.resume is not None:
        rc.restore(_recipe(scenario.resume, precision).snapshot, opts)
    scenario.recipe(rc, opts)
    return rc


@functools.cache
def recipe_outcome(name: str, precision: str) -> Run:
    return _recipe(name, precision).result()


@functools.cache
def module_class(package: str) -> type:
    api = lightning_api(package)

    class ScenarioModule(api.RecipeModule):
        """The oracle's ``RecipeModule`` running ``scenario.step`` on ``trainer_batches()[batch_idx]`` (the loader
        yields positions); :meth:`mark` snapshots weights and optimizer states (the start of every batch)."""

        def __init__(self, scenario: Scenario, precision: str) -> None:
            super().__init__(scenario.net(), scenario.configure, scenario.step, scenario.automatic, precision)
            self.scenario = scenario
            self.precision_name = precision
            self.steps = 0
            self.checkpoint_path: Optional[Path] = None
            self._mark: tuple = (snapshot(self.net.parameters()), None)

        @property
        def scaler(self) -> Optional[Any]:
            """What a user reaches for: ``self.trainer.precision_plugin.scaler`` (``None`` without one)."""
            return getattr(self.trainer.precision_plugin, "scaler", None)

        def save_point(self, batch_idx: int) -> None:
            """``self.trainer.save_checkpoint`` at the scenario's save point (not in a resumed run)."""
            if batch_idx == SAVE_AT and self.checkpoint_path is not None:
                self.trainer.save_checkpoint(self.checkpoint_path)

        def mark(self) -> None:
            optimizers = self.trainer.optimizers if self._trainer is not None else []
            self._mark = (snapshot(self.net.parameters()), _optimizer_states(optimizers))

        def unchanged_since_mark(self) -> bool:
            params, states = self._mark
            return same(params, snapshot(self.net.parameters())) and (
                states is None or same(states, _optimizer_states(self.trainer.optimizers))
            )

        def autocast(self) -> contextlib.AbstractContextManager:
            """The pieces both sides share open ``side.autocast()``: Lightning's is around the step already."""
            return contextlib.nullcontext()

        def configure_optimizers(self):
            if self.scenario.schedulers is None:
                return super().configure_optimizers()
            opts = self.scenario.configure(self.net)
            return opts, self.scenario.schedulers(opts)

        def on_train_batch_start(self, batch, batch_idx):
            self.mark()

        def training_step(self, batch, batch_idx):
            self.steps += 1
            self.batch_idx_now = batch_idx
            if self.scenario.resume is not None:
                self.records.append(("batch", batch_idx))
            return self.scenario.step(self, trainer_batches()[batch_idx], batch_idx)

        def on_train_epoch_end(self):
            if self.scenario.epoch_end is not None:
                self.scenario.epoch_end(self)

    return ScenarioModule


_CHECKPOINTS = tempfile.TemporaryDirectory(prefix="amp-scenarios-")


def _checkpoint_path(package: str, name: str, precision: str) -> Path:
    return Path(_CHECKPOINTS.name) / f"{package}-{name}-{precision}.ckpt"


@functools.cache
def lightning_outcome(package: str, name: str, precision: str) -> Outcome:
    """Train scenario ``name`` through the Trainer of ``package``; the run, or the error and what it left behind."""
    if precision == "16-mixed":
        require_cpu_16_mixed()  # a user's own scaler (disabled, CUDA's) would not skip by itself, and autocast raises
    scenario = SCENARIOS[name]
    api = lightning_api(package)
    module = module_class(package)(scenario, precision)
    ckpt_path = None
    if scenario.resume is not None:
        saved_by = lightning_outcome(package, scenario.resume, precision)
        if saved_by.error is not None:
            return Outcome(error=RuntimeError(f"the run that saves the checkpoint failed: {saved_by.error!r}"))
        ckpt_path = _checkpoint_path(package, scenario.resume, precision)
    elif scenario.saves:
        module.checkpoint_path = _checkpoint_path(package, name, precision)
    extra = scenario.trainer(api) if callable(scenario.trainer) else dict(scenario.trainer)
    hooks = {hook: staticmethod(fn) for hook, fn in scenario.callback.items()}
    callbacks = [*extra.pop("callbacks", ()), type("ScenarioCallback", (api.Callback,), hooks)()]
    recorder = api.Recorder()
    try:
        scaler = None
        if precision == "16-mixed":
            scaler = scenario.scaler() if scenario.scaler is not None else new_scaler(init_scale=scenario.init_scale)
        trainer = make_trainer(
            api,
            precision,
            scaler=scaler,
            callbacks=[recorder, *callbacks],
            watch_misuse=scenario.watch_misuse,
            **{"max_epochs": scenario.epochs, **extra},
        )
        trainer.fit(module, train_dataloaders=Positions(scenario.batches), ckpt_path=ckpt_path)
    except Exception as err:  # the outcome is judged by the test
        unchanged = module.unchanged_since_mark() if module._trainer is not None else None
        return Outcome(error=err, unchanged=unchanged, steps=module.steps)
    return Outcome(run=recorder.run(module.net, module.records), steps=module.steps)


def _describe(outcome: Outcome) -> str:
    if outcome.error is not None:
        return f"raised {type(outcome.error).__name__}: {outcome.error}"
    return "trained"


def assert_outcome(outcome: Outcome, expected: Any, name: str, precision: str) -> None:
    """``outcome`` (of a Lightning run of scenario ``name``) is what ``expected`` says."""
    records = SCENARIOS[name].records
    if expected == EQUAL or isinstance(expected, Differs):
        if outcome.error is not None:
            raise AssertionError(f"expected a run, but it {_describe(outcome)}") from outcome.error
        if expected == EQUAL:
            assert_same_run(outcome.run, recipe_outcome(name, precision), records=records)
            return
        try:
            assert_same_run(outcome.run, recipe_outcome(name, precision), records=records)
        except AssertionError as err:
            what = expected.what
            assert what in str(err), f"differs otherwise than recorded ({what!r}): {err}"  # noqa: PT017
            return
        raise AssertionError("stock follows the recipe here, unlike what is recorded: update the record")
    if expected == NO_ERROR:
        assert outcome.error is None, f"expected no error, but it {_describe(outcome)}"
        return
    if isinstance(expected, EqualOrRaises):
        if outcome.error is None:
            assert_same_run(outcome.run, recipe_outcome(name, precision), records=records)
            return
        expected = expected.raises
    assert isinstance(expected, Raises), expected
    err = outcome.error
    if err is None:
        message = ""
        try:
            assert_same_run(outcome.run, recipe_outcome(name, precision), records=records)
        except AssertionError as why:
            message = f": it trains silently wrong ({why})"
        except Exception:  # noqa: S110 (no recipe for this scenario: the message stays short)
            pass
        raise AssertionError(
            f"expected {[t.__name__ for t in expected.types]} matching {expected.match!r}, no error{message}"
        )
    assert isinstance(err, expected.types), f"expected {[t.__name__ for t in expected.types]}, {_describe(outcome)}"
    assert re.search(expected.match, str(err)), f"message does not match {expected.match!r}: {str(err)!r}"
    if expected.not_match is not None:
        assert not re.search(expected.not_match, str(err)), f"message matches {expected.not_match!r}: {str(err)!r}"
    if expected.cause is not None:
        assert err.__cause__ is not None, f"cause: {err.__cause__!r}"
        assert re.search(expected.cause, str(err.__cause__)), f"cause: {err.__cause__!r}"
    if expected.before_training:
        assert outcome.steps == 0, f"raised only after {outcome.steps} training steps"
    if expected.unchanged:
        assert outcome.unchanged is not False, "the step that raised changed the weights or the optimizer state"


# --------------------------------------------------------------------------------------------------------------------
# pieces both sides share (what the user writes once: losses, gradient surgery, weight edits)
# --------------------------------------------------------------------------------------------------------------------


def grads_finite(opt: Any) -> bool:
    return all(torch.isfinite(p.grad).all() for p in optimizer_params(opt) if p.grad is not None)


def has_grads(opt: Any) -> bool:
    return any(p.grad is not None for p in optimizer_params(opt))


def two_task_losses(net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_idx: int, inf_at) -> list[torch.Tensor]:
    """Two tasks on one output whose gradients often conflict; the first task's loss gets the injected inf."""
    out = net(x)
    return [inject_inf(F.mse_loss(out, y), batch_idx, inf_at), F.mse_loss(out, y.flip(1))]


def pcgrad(task_grads: list[tuple[torch.Tensor, ...]]) -> tuple[list[torch.Tensor], bool]:
    """PCGrad (Yu et al. 2020): project each task's gradient off the others' where they conflict, then sum. The
    projection is invariant to a common loss scale, so it may run on scaled gradients. Returns the summed gradient per
    parameter and whether any projection happened."""
    shapes = [g.shape for g in task_grads[0]]
    flat = [torch.cat([g.reshape(-1) for g in grads]) for grads in task_grads]
    projected, conflict = [], False
    for i, gi in enumerate(flat):
        g = gi.clone()
        for j, gj in enumerate(flat):
            dot = torch.dot(g, gj)
            if i != j and dot < 0:
                g = g - dot / torch.dot(gj, gj) * gj
                conflict = True
        projected.append(g)
    total = torch.stack(projected).sum(0)
    return list(torch.split(total, [s.numel() for s in shapes])), conflict


def assign_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.view_as(p).clone()


def gradient_penalty(loss: torch.Tensor, scaled_grads: tuple[torch.Tensor, ...], inv_scale: float) -> torch.Tensor:
    """torch's AMP example: unscale the gradients of the scaled loss (out of place), add their norm to the loss."""
    grads = [g * inv_scale for g in scaled_grads]
    norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
    return loss + norm


#: Reptile-style inner update: learning rate of the in-place step between the two forwards
INNER_LR = 0.05
#: weight clamp between the two forwards: this MLP's initial weights reach +-0.35, so it really clamps
CLAMP = 0.2
#: SAM's neighbourhood size
RHO = 0.05


@torch.no_grad()
def inner_update(params: list[torch.Tensor], grads: tuple[torch.Tensor, ...]) -> None:
    for p, g in zip(params, grads):
        p.sub_(INNER_LR * g)


@torch.no_grad()
def clamp_weights(params: list[torch.Tensor]) -> bool:
    before = [p.clone() for p in params]
    for p in params:
        p.clamp_(-CLAMP, CLAMP)
    return any(not torch.equal(b, p) for b, p in zip(before, params))


def sam_perturbation(grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    norm = torch.stack([g.norm() for g in grads]).norm()
    return [RHO * g / (norm + 1e-12) for g in grads]


@torch.no_grad()
def shift(params: list[torch.Tensor], deltas: list[torch.Tensor], sign: float) -> None:
    for p, d in zip(params, deltas):
        p.add_(sign * d)


class TwoHeads(nn.Module):
    """An MLP body and an auxiliary head that only every second batch uses: the head's optimizer then has no
    gradients at its step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        torch.manual_seed(3)
        self.head = nn.Linear(OUT_FEATURES, OUT_FEATURES)

    def loss(self, x: torch.Tensor, y: torch.Tensor, batch_idx: int, inf_at) -> torch.Tensor:
        out = self.body(x)
        loss = inject_inf(F.mse_loss(out, y), batch_idx, inf_at)
        if batch_idx % 2 == 0:
            loss = loss + F.mse_loss(self.head(out), y)
        return loss


def two_heads_optimizers(net: TwoHeads) -> list:
    return [make_optimizer("SGD", net.body.parameters()), make_optimizer("SGD", net.head.parameters())]


def fused_adamw(net: nn.Module) -> list:
    return [optimizer(torch.optim.AdamW, net.parameters(), lr=1e-2, fused=True)]


# --------------------------------------------------------------------------------------------------------------------
# the scenarios: recipe loops and training_step bodies
# --------------------------------------------------------------------------------------------------------------------


def save_in_on_before_second_step(trainer, pl_module, optimizer) -> None:
    """A callback saving a checkpoint in ``on_before_optimizer_step`` of the second of two optimizers."""
    if getattr(optimizer, "optimizer", optimizer) is trainer.optimizers[1]:
        pl_module.save_point(pl_module.batch_idx_now)


EPOCH_BATCHES, EPOCHS = 4, 3


def step_backward_every_batch(self, batch, batch_idx):
    # full-epoch accumulation: backward every batch, the step in on_train_epoch_end; an inf in the second epoch
    x, y = batch
    at = self.inf_at if self.current_epoch == 1 else None
    self.manual_backward(inject_inf(mlp_loss(self.net, x, y), batch_idx, at) / EPOCH_BATCHES)


def epoch_end_step(self):
    opt = self.optimizers()
    opt.step()
    opt.zero_grad()


def recipe_epoch_end_step(rc: RecipeRun, opts: list) -> None:
    (opt,) = opts
    for epoch in range(EPOCHS):
        for i, (x, y) in rc.batches():
            with rc.autocast():
                loss = inject_inf(mlp_loss(rc.net, x, y), i, rc.inf_at if epoch == 1 else None) / EPOCH_BATCHES
            rc.scaler.scale(loss).backward()
        rc.scaler.step(opt)
        rc.scaler.update()
        opt.zero_grad()


#: a loss scale this MLP's fp16 backward overflows at: the first steps are skipped until the scale backed off
OVERFLOWING_SCALE = 2.0**20


def clip_and_guard_lightning(self, opt: Any) -> bool:
    # clip, then skip the step on non-finite gradients (a common user guard)
    self.clip_gradients(opt, **clip_args("norm"))
    self.records.append(grads_finite(opt))
    return self.records[-1]


def clip_and_guard(rc: RecipeRun, opt: torch.optim.Optimizer) -> bool:
    # the recipe's update() runs in every iteration that unscaled: a skipped step still backs the scale off
    rc.scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(optimizer_params(opt), CLIP_NORM)
    rc.records.append(grads_finite(opt))
    return rc.records[-1]


def has_backward(batch_idx: int) -> bool:
    """All but batch 3, whose step still runs on the zeroed gradients (momentum moves the weights on zeros too)."""
    return batch_idx != 3


def clip_b_every_batch_step_every_second(self, batch, batch_idx):
    opt_a, opt_b = self.optimizers()
    x, y = batch
    opt_a.zero_grad()
    self.manual_backward(inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at))
    self.clip_gradients(opt_b, **clip_args("norm"))
    opt_a.step()
    if batch_idx % 2 == 1:
        opt_b.step()
        opt_b.zero_grad()


def recipe_clip_b_every_batch_step_every_second(rc: RecipeRun, opts: list) -> None:
    # B's unscaled gradients wait across the batch's update: the carry (x the new scale) written with torch's ops, as
    # the fork applies it; torch's own loop cannot do this (it would step B on two scales mixed)
    opt_a, opt_b = opts
    for i, (x, y) in rc.batches():
        opt_a.zero_grad()
        with rc.autocast():
            loss = rc.inject(mlp_loss(rc.net, x, y), i)
        rc.scaler.scale(loss).backward()
        rc.scaler.unscale_(opt_b)
        torch.nn.utils.clip_grad_norm_(optimizer_params(opt_b), CLIP_NORM)
        rc.scaler.step(opt_a)
        if i % 2 == 1:
            rc.scaler.step(opt_b)
            opt_b.zero_grad()
        rc.scaler.update()
        if i % 2 == 0:
            for p in optimizer_params(opt_b):
                p.grad.mul_(rc.scaler.get_scale())


def pcgrad_step(self, batch, batch_idx):
    opt = self.optimizers()
    x, y = batch
    params = trainable(self.net)
    scale = self.scaler.scale if self.scaler is not None else lambda loss: loss
    losses = two_task_losses(self.net, x, y, batch_idx, self.inf_at)
    task_grads = [torch.autograd.grad(scale(loss), params, retain_graph=True) for loss in losses]
    total, conflict = pcgrad(task_grads)
    self.records.append(conflict)
    opt.zero_grad()
    assign_grads(params, total)
    opt.step()


def recipe_pcgrad(rc: RecipeRun, opts: list) -> None:
    (opt,) = opts
    params = trainable(rc.net)
    for i, (x, y) in rc.batches():
        with rc.autocast():
            losses = two_task_losses(rc.net, x, y, i, rc.inf_at)
        task_grads = [torch.autograd.grad(rc.scaler.scale(loss), params, retain_graph=True) for loss in losses]
        total, conflict = pcgrad(task_grads)
        rc.records.append(conflict)
        opt.zero_grad()
        assign_grads(params, total)
        rc.scaler.step(opt)
        rc.scaler.update()


AUX_WEIGHT = 1e-3


def aux_loss(net: nn.Module) -> torch.Tensor:
    return AUX_WEIGHT * torch.stack([p.pow(2).sum() for p in trainable(net)]).sum()


def aux_plain_backward(self, batch, batch_idx):
    # misuse: the auxiliary loss bypasses the scaler
    opt = self.optimizers()
    x, y = batch
    opt.zero_grad()
    main = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
    aux = aux_loss(self.net)
    self.manual_backward(main)
    aux.backward()
    opt.step()


def recipe_main_and_aux(rc: RecipeRun, opts: list) -> None:
    # what the user meant: both losses scaled
    (opt,) = opts
    for i, (x, y) in rc.batches():
        opt.zero_grad()
        with rc.autocast():
            main = rc.inject(mlp_loss(rc.net, x, y), i)
            aux = aux_loss(rc.net)
        rc.scaler.scale(main).backward()
        rc.scaler.scale(aux).backward()
        rc.scaler.step(opt)
        rc.scaler.update()


def gradient_penalty_step(self, batch, batch_idx):
    # torch's "gradient penalty" AMP example, in a LightningModule
    opt = self.optimizers()
    x, y = batch
    params = trainable(self.net)
    scaler = self.scaler
    loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
    scaled = torch.autograd.grad(scaler.scale(loss) if scaler else loss, params, create_graph=True)
    loss = gradient_penalty(loss, scaled, 1.0 / scaler.get_scale() if scaler else 1.0)
    opt.zero_grad()
    self.manual_backward(loss)
    opt.step()


def recipe_gradient_penalty(rc: RecipeRun, opts: list) -> None:
    (opt,) = opts
    params = trainable(rc.net)
    for i, (x, y) in rc.batches():
        with rc.autocast():
            loss = rc.inject(mlp_loss(rc.net, x, y), i)
        scaled = torch.autograd.grad(rc.scaler.scale(loss), params, create_graph=True)
        with rc.autocast():
            loss = gradient_penalty(loss, scaled, 1.0 / rc.scaler.get_scale())
        opt.zero_grad()
        rc.scaler.scale(loss).backward()
        rc.scaler.step(opt)
        rc.scaler.update()


# The ``before`` pieces below run on either side (``side``: the RecipeRun or the module, each with ``net``,
# ``autocast()`` and ``records``), between ``recipe_one_optimizer``'s or ``manual_one_optimizer``'s steps.


def reptile_inner_update(side: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    # an inner SGD step written in place between two forwards (first-order meta-learning)
    params = trainable(side.net)
    with side.autocast():
        inner = mlp_loss(side.net, x[:2], y[:2])
    inner_update(params, torch.autograd.grad(inner, params))


def second_half_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return mlp_loss(net, x[2:], y[2:])


def forward_then_clamp(side: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    # a no_grad forward (a metric), the weights clamped in place (a constraint), then the training forward
    with side.autocast(), torch.no_grad():
        side.net(x)
    side.records.append(clamp_weights(trainable(side.net)))


def sam_perturb(side: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    # SAM with autograd.grad: perturb the weights in place, forward and backward there (the step), restore, step
    params = trainable(side.net)
    with side.autocast():
        first = mlp_loss(side.net, x, y)
    side.sam_eps = sam_perturbation(torch.autograd.grad(first, params))
    shift(params, side.sam_eps, +1.0)


def sam_restore(side: Any, opt: Any) -> bool:
    shift(trainable(side.net), side.sam_eps, -1.0)
    return True


def loss_scale_monitor_trainer(api) -> dict:
    return {
        "accumulate_grad_batches": 2,
        "callbacks": [api.pl.callbacks.LossScaleMonitor()],
        "logger": api.pl.loggers.CSVLogger(_CHECKPOINTS.name, name="loss-scale-monitor"),
        "log_every_n_steps": 1,
    }


def record_monitor_history(trainer, pl_module) -> None:
    (monitor,) = [c for c in trainer.callbacks if type(c).__name__ == "LossScaleMonitor"]
    pl_module.records.append(("logged", copy.deepcopy(monitor.history)))


def recipe_accumulate_clip(rc: RecipeRun, opts: list) -> None:
    # a step every 2nd batch on the sum of two halved losses, clipped on the stepping batches only
    (opt,) = opts
    for i, (x, y) in rc.batches():
        with rc.autocast():
            loss = rc.inject(mlp_loss(rc.net, x, y), i) / 2
        rc.scaler.scale(loss).backward()
        if i % 2 == 1:
            rc.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(optimizer_params(opt), CLIP_NORM)
            rc.scaler.step(opt)
            rc.scaler.update()
            opt.zero_grad()


def accumulate_clip_step(self, batch, batch_idx):
    opt = self.optimizers()
    x, y = batch
    self.manual_backward(inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at) / 2)
    if batch_idx % 2 == 1:
        self.clip_gradients(opt, **clip_args("norm"))
        opt.step()
        opt.zero_grad()


def _clips(result: Run) -> bool:
    """Clipping by norm really clipped: a finite pre-clip norm above the limit was recorded."""
    norms = [norm for kind, norm in result.records if kind == "norm"]
    return any(math.isfinite(norm) and norm > CLIP_NORM for norm in norms)


def recipe_monitored_accumulation(rc: RecipeRun, opts: list) -> None:
    """Accumulation over 2 batches, then what ``LossScaleMonitor`` must log: once per optimizer step, the scale after
    it and the number of skipped steps so far."""
    recipe_accumulate(rc, opts)
    stepped = range(1, rc.stop, 2)
    skipped = [sum(not rc.changed[j] for j in stepped if j <= i) for i in stepped]
    rc.records.append((
        "logged",
        {"loss_scale": [rc.scales[i] for i in stepped], "skipped_steps": [float(s) for s in skipped]},
    ))


def two_heads_step(self, batch, batch_idx):
    opt_a, opt_b = self.optimizers()
    x, y = batch
    opt_a.zero_grad()
    opt_b.zero_grad()
    self.manual_backward(self.net.loss(x, y, batch_idx, self.inf_at))
    opt_a.step()
    opt_b.step()


def recipe_two_heads(rc: RecipeRun, opts: list) -> None:
    # the recipe steps an optimizer only when it has gradients (torch asserts "No inf checks were recorded" otherwise)
    opt_a, opt_b = opts
    for i, (x, y) in rc.batches():
        opt_a.zero_grad()
        opt_b.zero_grad()
        with rc.autocast():
            loss = rc.net.loss(x, y, i, rc.inf_at)
        rc.scaler.scale(loss).backward()
        rc.scaler.step(opt_a)
        if has_grads(opt_b):
            rc.scaler.step(opt_b)
        rc.scaler.update()


def _other_dtype(precision: str) -> torch.dtype:
    if precision == "bf16-mixed":
        require_cpu_fp16_autocast()
    return torch.float16 if precision == "bf16-mixed" else torch.bfloat16


def weight_in_two_dtypes_automatic(self, batch, batch_idx):
    # a layer used inside a nested autocast region of the other low-precision dtype and again outside it
    x, y = batch
    with torch.autocast("cpu", dtype=_other_dtype(self.precision_name)):
        inner = self.net[0](x)
    return F.mse_loss(self.net(x), y) + inner.float().mean()


def weight_in_two_dtypes(self, batch, batch_idx):
    opt = self.optimizers()
    loss = weight_in_two_dtypes_automatic(self, batch, batch_idx)
    opt.zero_grad()
    self.manual_backward(loss)
    opt.step()


#: torch's message for a conv on a CPU input with CUDA weights (a device mismatch worded "should be the same"); this
#: machine has no CUDA, so the step raises it as torch would
CONV_DEVICE_MISMATCH = (
    "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same or input should be a"
    " MKLDNN tensor and weight is a dense tensor"
)


def device_mismatch_conv(self, batch, batch_idx):
    self.net(batch[0])
    raise RuntimeError(CONV_DEVICE_MISMATCH)


def device_mismatch_meta(self, batch, batch_idx):
    # a real device mismatch: "Tensor on device meta is not on the expected device cpu!"
    x, _ = batch
    return torch.cat([self.net(x), torch.zeros(1, OUT_FEATURES, device="meta")]).sum()


def step_lr(opts: list) -> list:
    return [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8) for opt in opts]


def scheduler_unless_skipped(self, batch, batch_idx):
    # manual optimization's way to keep a step-interval scheduler off skipped steps
    opt = self.optimizers()
    scheduler = self.lr_schedulers()
    x, y = batch
    opt.zero_grad()
    self.manual_backward(inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at))
    opt.step()
    if not opt.step_was_skipped:
        scheduler.step()
    self.records.append(scheduler.get_last_lr())


def recipe_scheduler_unless_skipped(rc: RecipeRun, opts: list) -> None:
    # torch's idiom: the step was skipped if update() lowered the scale
    (opt,) = opts
    (scheduler,) = step_lr(opts)
    for i, (x, y) in rc.batches():
        opt.zero_grad()
        with rc.autocast():
            loss = rc.inject(mlp_loss(rc.net, x, y), i)
        rc.scaler.scale(loss).backward()
        before = rc.scaler.get_scale()
        rc.scaler.step(opt)
        rc.scaler.update()
        if not rc.scaler.get_scale() < before:
            scheduler.step()
        rc.records.append(scheduler.get_last_lr())


def gan_toggle_step(self, batch, batch_idx):
    # Lightning's GAN example: G then D, each between toggle_optimizer and untoggle_optimizer
    opt_g, opt_d = self.optimizers()
    real, noise = batch
    net = self.net
    self.toggle_optimizer(opt_g)
    fake = net.gen(noise)
    g_loss = inject_inf(net.g_loss(fake), batch_idx, self.inf_at)
    self.manual_backward(g_loss)
    opt_g.step()
    opt_g.zero_grad()
    self.untoggle_optimizer(opt_g)
    self.toggle_optimizer(opt_d)
    self.manual_backward(inject_inf(net.d_loss(real, fake) / 2, batch_idx, self.late_inf_at))
    opt_d.step()
    opt_d.zero_grad()
    self.untoggle_optimizer(opt_d)


def recipe_gan_toggle(rc: RecipeRun, opts: list) -> None:
    # toggling an optimizer switches requires_grad off for the parameters of the others
    opt_g, opt_d = opts
    net = rc.net
    for i, (real, noise) in rc.batches():
        net.disc.requires_grad_(False)
        with rc.autocast():
            fake = net.gen(noise)
            g_loss = rc.inject(net.g_loss(fake), i)
        rc.scaler.scale(g_loss).backward()
        rc.scaler.step(opt_g)
        rc.scaler.update()  # owed by G's step, before D's backward: nothing else waits for it
        opt_g.zero_grad()
        net.disc.requires_grad_(True)
        net.gen.requires_grad_(False)
        with rc.autocast():
            d_loss = rc.inject_late(net.d_loss(real, fake) / 2, i)
        rc.scaler.scale(d_loss).backward()
        rc.scaler.step(opt_d)
        opt_d.zero_grad()
        net.gen.requires_grad_(True)
        rc.scaler.update()


def _gen_then_disc(net: GAN) -> list:
    return [make_optimizer("AdamW", net.gen.parameters()), make_optimizer("AdamW", net.disc.parameters())]


def recipe_closure(rc: RecipeRun, opts: list) -> None:
    # the closure's forward runs under autocast: its output has the autocast dtype
    recipe_plain(rc, opts)
    rc.records.extend([rc.dtype or torch.float32] * (rc.stop - rc.start))


_gan_sgd = functools.partial(gan_optimizers, name="SGD")
_gan_adamw = functools.partial(gan_optimizers, name="AdamW")
_two_sgd = functools.partial(two_optimizers, name="SGD")


def _recorded_some(result: Run) -> bool:
    """Some batch really did it (PCGrad projected, the clamp clamped)."""
    return any(result.records)


def _skips_some_steps(result: Run) -> bool:
    """The guard skipped some steps and took others."""
    return any(result.records) and not all(result.records)


#: torch's own message first (the error keeps its type), then the fork's hint
_NAMES_THE_CACHE_SWITCH = Raises((RuntimeError,), r"(?s)^mat1 and mat2 must have the same dtype.*cache_enabled=False")


def _lr_held_on_the_skipped_step(result: Run) -> bool:
    lrs = result.records
    return lrs[INF_BATCH] == lrs[INF_BATCH - 1] and lrs[INF_BATCH + 1] != lrs[INF_BATCH]


_MANUAL_BACKWARD = Raises(CLEAR_ERRORS, r"manual_backward")
_CONV_MISMATCH = Raises((RuntimeError,), rf"^{re.escape(CONV_DEVICE_MISMATCH)}$")
_META_MISMATCH = Raises((RuntimeError,), r"^Tensor on device meta is not on the expected device cpu!$")
_SCALER_FIRST = Raises(CLEAR_ERRORS, r"(?i)scaler", before_training=True)
_FUSED = Raises((RuntimeError,), r"(?i)fused", unchanged=False)


def _scenarios() -> list[Scenario]:
    gan_between = manual_gan_step(between=lambda module, batch_idx: module.save_point(batch_idx))
    guard = Scenario(
        "guard_skips_step_on_nonfinite_grads",
        "clip, find non-finite gradients, skip opt.step(): the scale must still back off",
        manual_one_optimizer(before_step=clip_and_guard_lightning),
        recipe_one_optimizer(before_step=clip_and_guard),
        P16,
        stock=Differs("scale trajectory"),
        init_scale=OVERFLOWING_SCALE,
        sharp=_skips_some_steps,
    )
    scaler_disabled = Scenario(
        "scaler_disabled_by_the_user",
        "MixedPrecision('16-mixed', scaler=GradScaler('cpu', enabled=False)): a clear error first",
        manual_one_optimizer(inject=False),
        None,
        P16,
        _SCALER_FIRST,
        NO_ERROR,
        scaler=lambda: cpu_grad_scaler(enabled=False),
    )
    fused_manual = Scenario(
        "fused_adamw_clip_manual",
        "pattern: AdamW(fused=True) with clip_gradients in manual optimization",
        manual_clip("norm"),
        recipe_clip("norm"),
        stock=_FUSED,
        configure=fused_adamw,
        records=False,
    )
    return [
        # ---- usage patterns -----------------------------------------------------------------------------------
        *save_and_resume(
            "between_gan_d_step_and_g_backward",
            "trainer.save_checkpoint mid-iteration must not change the live run",
            step=gan_between,
            recipe=recipe_gan,
            resume_stock=Differs("scale trajectory"),
            net=GAN,
            configure=_gan_sgd,
        ),
        *save_and_resume(
            "in_on_before_optimizer_step_of_second_optimizer",
            "a callback saving before the second of two optimizers fed by one backward",
            step=manual_two_optimizers,
            recipe=recipe_two_optimizers,
            stock=Differs("scale trajectory"),
            resume_stock=Differs("scale trajectory"),
            configure=_two_sgd,
            callback={"on_before_optimizer_step": save_in_on_before_second_step},
        ),
        Scenario(
            "step_in_on_train_epoch_end",
            "backward every batch, opt.step() in on_train_epoch_end (full-epoch accumulation)",
            step_backward_every_batch,
            recipe_epoch_end_step,
            epoch_end=epoch_end_step,
            batches=EPOCH_BATCHES,
            epochs=EPOCHS,
        ),
        guard,
        replace(
            guard,
            name="guard_skips_step_zero_grad_keeps_zeros",
            about="the same guard with zero_grad(set_to_none=False)",
            step=manual_one_optimizer(set_to_none=False, before_step=clip_and_guard_lightning),
            recipe=recipe_one_optimizer(set_to_none=False, before_step=clip_and_guard),
        ),
        Scenario(
            "step_on_zeroed_grads_without_backward",
            "zero_grad(set_to_none=False), a batch without backward that still steps (momentum)",
            manual_one_optimizer(set_to_none=False, backward_at=has_backward),
            recipe_one_optimizer(set_to_none=False, backward_at=has_backward),
        ),
        Scenario(
            "two_optimizers_b_clipped_every_batch_stepped_every_second",
            "B's unscaled gradients wait across the batch's end: carried into the new scale, then accumulated on",
            clip_b_every_batch_step_every_second,
            recipe_clip_b_every_batch_step_every_second,
            P16,
            stock=Differs("scale trajectory"),
            configure=_two_sgd,
        ),
        Scenario(
            "pcgrad_autograd_grad_of_scaled_losses",
            "gradient surgery on torch.autograd.grad(scaler.scale(loss_i)) assigned to .grad",
            pcgrad_step,
            recipe_pcgrad,
            PRECISIONS,
            sharp=_recorded_some,
        ),
        Scenario(
            "misuse_aux_loss_backward_next_to_manual_backward",
            "aux.backward() next to self.manual_backward(main)",
            aux_plain_backward,
            recipe_main_and_aux,
            P16,
            _MANUAL_BACKWARD,
            Differs("parameters differ"),
            watch_misuse=True,
        ),
        Scenario(
            "misuse_gan_g_loss_backward",
            "G's loss.backward() after D used manual_backward",
            manual_gan_step(plain_g_backward=True),
            recipe_gan,
            P16,
            _MANUAL_BACKWARD,
            Differs("parameters differ"),
            net=GAN,
            configure=_gan_sgd,
            watch_misuse=True,
        ),
        Scenario(
            "raw_optimizer_step",
            "self.optimizers(use_pl_optimizer=False).step(): raise, or step like the recipe",
            manual_one_optimizer(raw=True),
            recipe_plain,
            expect={
                "16-mixed": EqualOrRaises(Raises(CLEAR_ERRORS, r"use_pl_optimizer|LightningOptimizer")),
                "bf16-mixed": EQUAL,
            },
            stock={"16-mixed": Differs("scale trajectory"), "bf16-mixed": EQUAL},
            watch_misuse=True,
        ),
        Scenario(
            "gradient_penalty",
            "torch's AMP gradient-penalty example (autograd.grad of the scaled loss, create_graph)",
            gradient_penalty_step,
            recipe_gradient_penalty,
            PRECISIONS,
        ),
        scaler_disabled,
        replace(
            scaler_disabled,
            name="scaler_disabled_by_the_user_automatic",
            about="the same in automatic optimization",
            step=auto_plain,
            automatic=True,
        ),
        replace(
            scaler_disabled,
            name="cuda_scaler_on_cpu",
            about="GradScaler('cuda') on a CPU run (torch disables it): a clear error first",
            scaler=cuda_grad_scaler,
        ),
        Scenario(
            "inplace_inner_update_between_forwards",
            "a Reptile-style inner step written in place between two forwards",
            manual_one_optimizer(second_half_loss, before=reptile_inner_update),
            recipe_one_optimizer(second_half_loss, before=reptile_inner_update),
        ),
        Scenario(
            "inplace_clamp_between_forwards",
            "weights clamped in place after a no_grad forward, before the training forward",
            manual_one_optimizer(before=forward_then_clamp),
            recipe_one_optimizer(before=forward_then_clamp),
            sharp=_recorded_some,
        ),
        Scenario(
            "inplace_perturbation_between_forwards",
            "SAM written with autograd.grad: perturb in place, forward/backward, restore, step",
            manual_one_optimizer(before=sam_perturb, before_step=sam_restore),
            recipe_one_optimizer(before=sam_perturb, before_step=sam_restore),
        ),
        Scenario(
            "loss_scale_monitor_under_accumulation",
            "LossScaleMonitor logs once per optimizer step under gradient accumulation",
            auto_plain,
            recipe_monitored_accumulation,
            P16,
            stock=MISSING,
            automatic=True,
            trainer=loss_scale_monitor_trainer,
            callback={"on_train_end": record_monitor_history},
        ),
        Scenario(
            "optimizer_without_gradients",
            "an optimizer whose parameters got no gradient: a clear error or the recipe's skip",
            two_heads_step,
            recipe_two_heads,
            expect={"16-mixed": EqualOrRaises(Raises(CLEAR_ERRORS, r"(?i)gradient")), "bf16-mixed": EQUAL},
            stock={"16-mixed": Raises((AssertionError,), r"No inf checks", unchanged=False), "bf16-mixed": EQUAL},
            net=TwoHeads,
            configure=two_heads_optimizers,
        ),
        Scenario(
            "nested_autocast_dtype_mismatch_linear_manual",
            "a weight in two low-precision dtypes in manual optimization, where the cache is off by default",
            weight_in_two_dtypes,
            None,
            expect=NO_ERROR,
            stock=NO_ERROR,
        ),
        Scenario(
            "nested_autocast_dtype_mismatch_linear_automatic",
            "nn.Linear's 'mat1 and mat2 must have the same dtype' (cache on in automatic optimization) keeps"
            " torch's message and type and names the cache switch",
            weight_in_two_dtypes_automatic,
            None,
            expect=_NAMES_THE_CACHE_SWITCH if AUTOCAST_CACHE else NO_ERROR,
            stock=NO_ERROR,
            automatic=True,
        ),
        Scenario(
            "device_mismatch_not_rewritten",
            "a device mismatch worded 'should be the same' keeps its message",
            device_mismatch_conv,
            None,
            expect=Raises((RuntimeError,), _CONV_MISMATCH.match, not_match="cache_enabled"),
            stock=_CONV_MISMATCH,
        ),
        Scenario(
            "device_mismatch_meta_not_rewritten",
            "torch's own device-mismatch error keeps its message",
            device_mismatch_meta,
            None,
            expect=_META_MISMATCH,
            stock=_META_MISMATCH,
            automatic=True,
        ),
        # ---- manual-optimization patterns of real projects ----------------------------------------------------------
        Scenario(
            "gan_d_then_g",
            "pattern: GAN, D step then G's loss through the updated D, two optimizers",
            manual_gan,
            recipe_gan,
            PRECISIONS,
            net=GAN,
            configure=_gan_adamw,
        ),
        Scenario(
            "gan_toggle_optimizer",
            "pattern: Lightning's GAN example, G then D, toggle_optimizer/untoggle_optimizer around each",
            gan_toggle_step,
            recipe_gan_toggle,
            PRECISIONS,
            net=GAN,
            configure=_gen_then_disc,
        ),
        Scenario(
            "scheduler_steps_unless_step_was_skipped",
            "pattern: a step-interval LR scheduler in manual optimization, not stepped on skipped steps",
            scheduler_unless_skipped,
            recipe_scheduler_unless_skipped,
            P16,
            stock=Raises((AttributeError,), r"step_was_skipped", unchanged=False),
            schedulers=step_lr,
            sharp=_lr_held_on_the_skipped_step,
        ),
        Scenario(
            "clip_gradients_returns_the_unscaled_norm",
            "self.clip_gradients returns the total norm of the unscaled gradients, as torch's does",
            manual_clip("norm"),
            recipe_clip("norm"),
            PRECISIONS,
            stock={
                "16-mixed": Differs("parameters differ"),
                "bf16-mixed": Differs("records"),
                "32": Differs("records"),
            },
            sharp=_clips,
        ),
        Scenario(
            "accumulate_clip_on_stepping_batches",
            "pattern: gradient accumulation over 2 batches, clipping only on the stepping batches",
            accumulate_clip_step,
            recipe_accumulate_clip,
            PRECISIONS,
            stock={"16-mixed": Differs("parameters differ"), "bf16-mixed": EQUAL, "32": EQUAL},
        ),
        Scenario(
            "closure",
            "pattern: opt.step(closure) with forward and manual_backward in the closure",
            manual_closure,
            recipe_closure,
        ),
        Scenario(
            "two_optimizers_one_backward",
            "pattern: several optimizers fed by one backward",
            manual_two_optimizers,
            recipe_two_optimizers,
            stock={"16-mixed": Differs("scale trajectory"), "bf16-mixed": EQUAL},
            configure=_two_sgd,
        ),
        Scenario(
            "inner_loop_two_steps_per_batch",
            "pattern: one optimizer stepped twice per training_step (each step its update, as torch's scaler needs)",
            manual_multi_step,
            recipe_multi_step,
        ),
        Scenario(
            "automatic_accumulate_and_clip",
            "pattern: automatic optimization, accumulate_grad_batches=2, gradient_clip_val",
            auto_plain,
            recipe_accumulate_clip,
            PRECISIONS,
            automatic=True,
            trainer={"accumulate_grad_batches": 2, "gradient_clip_val": CLIP_NORM},
        ),
        fused_manual,
        replace(
            fused_manual,
            name="fused_adamw_clip_automatic",
            about="pattern: AdamW(fused=True) with gradient_clip_val in automatic optimization",
            step=auto_plain,
            automatic=True,
            trainer={"gradient_clip_val": CLIP_NORM},
        ),
    ]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in _scenarios()}
CELLS = [cell for s in SCENARIOS.values() for cell in s.cells()]
