"""Machinery for the fused-optimizer mixed-precision tests (``plugins/precision/test_amp_fused.py``).

A cell of the matrix is ``(optimizer, fused, precision, clip, mode)``. It trains a tiny MLP (8 -> 16 -> 4, fp32
parameters) over :data:`N_BATCHES` fixed batches of :data:`BATCH_SIZE`, either

* through the Lightning ``Trainer`` (:func:`lightning_run`), recording in ``on_before_optimizer_step`` a copy of every
  parameter's gradient and, around every batch, whether the parameters and the optimizer state changed and the loss
  scale before and after; or
* through a hand-written loop following PyTorch's AMP recipe (:func:`recipe_run`): autocast around forward and loss
  only, ``scaler.scale(loss).backward()``, ``scaler.unscale_(opt)``, clipping, ``scaler.step(opt)``,
  ``scaler.update()``. It records the same things at the same places, plus what clipping saw (to prove it clipped).

Both sides share only what a user writes once: network, data, optimizer construction. Results are cached per cell, so
the fused cell and its unfused reference are trained once each even though several tests compare them.

Loss scales are powers of two (unscaling is then exact in fp32, so the Lightning run and the recipe are bitwise
comparable) and ``growth_interval=1`` (the scale moves after every update, so a missing, extra or misplaced
``update()`` shows in the trajectory). Under 16-mixed the loss of batch :data:`INF_BATCH` is multiplied by ``inf``.
"""

import contextlib
import functools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from amp_oracle.torch_features import optimizer
from amp_oracle.trainer import FORK
from amp_oracle.trainer import lightning_api as shared_lightning_api
from amp_oracle.trainer import make_trainer as shared_make_trainer
from amp_oracle.world import (
    CLIP_NORM,
    CLIP_VALUE,
    INIT_SCALE,
    N_BATCHES,
    autocast_dtype,
    inf_batch,
    inject_inf,
    mlp,
    mlp_loss,
    new_scaler,
    optimizer_params,
    uses_scaler,
)
from amp_oracle.world import make_batches as world_batches
from torch import nn

OPTIMIZERS = ("Adam", "AdamW", "SGD-momentum", "SGD", "Adagrad")
PRECISIONS = ("16-mixed", "bf16-mixed")
CLIPS = ("none", "norm", "value")
MODES = ("automatic", "manual")


# --------------------------------------------------------------------------------------------------------------------
# what both sides share: network, data, optimizers
# --------------------------------------------------------------------------------------------------------------------


#: the shared MLP with this module's seed
make_net = functools.partial(mlp, seed=7)
#: the shared batches (:data:`N_BATCHES` of them) with this module's seed
make_batches = functools.partial(world_batches, seed=2024)


def loss_fn(net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_idx: int, inf_at: Optional[int]) -> torch.Tensor:
    return inject_inf(mlp_loss(net, x, y), batch_idx, inf_at)


class SelfUnscalingSGD(torch.optim.SGD):
    """An optimizer of the old protocol: ``GradScaler.step`` passes itself as ``grad_scaler`` and the optimizer checks
    for infs and unscales inside its own ``step()`` (as apex-style fused optimizers did). Its gradients are therefore
    still scaled before the step, and no one may unscale them first."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):  # type: ignore[override]
        if grad_scaler is not None:
            found_inf = sum(v.item() for v in grad_scaler._check_inf_per_device(self).values())
            if found_inf:
                return None
            inv_scale = grad_scaler._scale.double().reciprocal().float()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv_scale)
        return super().step(closure)


def make_optimizer(name: str, params: Any, fused: bool) -> torch.optim.Optimizer:
    """``fused=False`` is the for-loop implementation (``foreach=False`` spelled out: the reference path)."""
    impl = {"fused": True} if fused else {"fused": False, "foreach": False}
    if name == "Adam":
        return optimizer(torch.optim.Adam, params, lr=1e-2, **impl)
    if name == "AdamW":
        return optimizer(torch.optim.AdamW, params, lr=1e-2, weight_decay=0.1, **impl)
    if name == "SGD-momentum":
        return optimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9, dampening=0.0, **impl)
    if name == "SGD":
        return optimizer(torch.optim.SGD, params, lr=0.1, **impl)
    if name == "Adagrad":
        return optimizer(torch.optim.Adagrad, params, lr=0.1, **impl)
    if name == "SGD-dampening":
        return optimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9, dampening=0.1, **impl)
    if name == "SelfUnscalingSGD":
        assert not fused
        return SelfUnscalingSGD(params, lr=0.1, momentum=0.9, foreach=False)
    raise ValueError(name)


# --------------------------------------------------------------------------------------------------------------------
# what a run records
# --------------------------------------------------------------------------------------------------------------------


def _state_snapshot(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every parameter's optimizer state (``exp_avg``, ``step``, ``momentum_buffer``, ``sum``...), copied."""
    snap = []
    for p in optimizer_params(opt):
        state = opt.state.get(p, {})
        # torch < 2.2 keeps `momentum_buffer: None` for SGD without momentum: no state
        snap.append({
            k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items() if v is not None
        })
    return snap


def _same_state(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    if [sorted(s) for s in a] != [sorted(s) for s in b]:
        return False
    for sa, sb in zip(a, b):
        for k, va in sa.items():
            vb = sb[k]
            if isinstance(va, torch.Tensor):
                if not torch.equal(va, vb):
                    return False
            elif va != vb:
                return False
    return True


@dataclass
class BatchRecord:
    params_changed: bool
    state_changed: bool
    #: the loss scale before and after the batch (``None`` without a scaler)
    scale_before: Optional[float]
    scale_after: Optional[float]


@dataclass
class Run:
    #: final parameters by name
    params: dict[str, torch.Tensor]
    #: final optimizer state, per parameter in ``param_groups`` order
    state: list[dict[str, Any]]
    batches: list[BatchRecord]
    #: a copy of every parameter's gradient where the step reads it (Lightning: ``on_before_optimizer_step``)
    grads: list[dict[str, torch.Tensor]]
    #: recipe only: what clipping saw before clipping (total norm, or max abs gradient) on every step
    clip_seen: list[float] = field(default_factory=list)

    @property
    def scales(self) -> Optional[list[float]]:
        if self.batches[0].scale_after is None:
            return None
        return [b.scale_after for b in self.batches]

    @property
    def skipped(self) -> list[bool]:
        return [not b.params_changed for b in self.batches]


class _BatchWatcher:
    """Snapshots parameters, optimizer state and scale before a batch and compares after it."""

    def __init__(self, net: nn.Module, opt: torch.optim.Optimizer, get_scale: Callable[[], Optional[float]]) -> None:
        self.net, self.opt, self.get_scale = net, opt, get_scale
        self.records: list[BatchRecord] = []

    def before(self) -> None:
        self._params = [p.detach().clone() for p in self.net.parameters()]
        self._state = _state_snapshot(self.opt)
        self._scale = self.get_scale()

    def after(self) -> None:
        params_changed = any(not torch.equal(a, p) for a, p in zip(self._params, self.net.parameters()))
        state_changed = not _same_state(self._state, _state_snapshot(self.opt))
        self.records.append(BatchRecord(params_changed, state_changed, self._scale, self.get_scale()))


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------------------------------------------------
# the hand-written PyTorch AMP recipe
# --------------------------------------------------------------------------------------------------------------------


def recipe_run(
    optimizer: str,
    fused: bool,
    precision: str,
    clip: str,
    mode: str,
    inf_at: Any = "default",
    init_scale: float = INIT_SCALE,
) -> Run:
    """PyTorch's AMP recipe, written out. ``mode`` only decides where the gradients are recorded, as Lightning's hook
    sees them: before clipping in automatic optimization (the hook runs before the Trainer clips), after the user's
    ``clip_gradients`` in manual optimization (the hook runs inside ``opt.step()``)."""
    inf_at = inf_batch(precision) if inf_at == "default" else inf_at
    net = make_net()
    opt = make_optimizer(optimizer, net.parameters(), fused)
    scaler = new_scaler(init_scale=init_scale, enabled=uses_scaler(precision))
    watcher = _BatchWatcher(net, opt, scaler.get_scale if uses_scaler(precision) else (lambda: None))
    grads: list[dict[str, torch.Tensor]] = []
    clip_seen: list[float] = []
    for batch_idx, (x, y) in enumerate(make_batches()):
        watcher.before()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast_dtype(precision)):
            loss = loss_fn(net, x, y, batch_idx, inf_at)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if mode == "automatic":
            grads.append(_grads(net))
        params = optimizer_params(opt)
        if clip == "norm":
            clip_seen.append(torch.nn.utils.clip_grad_norm_(params, CLIP_NORM).item())
        elif clip == "value":
            clip_seen.append(max(p.grad.abs().max().item() for p in params))
            torch.nn.utils.clip_grad_value_(params, clip_value=CLIP_VALUE)
        if mode == "manual":
            grads.append(_grads(net))
        scaler.step(opt)
        scaler.update()
        watcher.after()
    return Run(
        params={n: p.detach().clone() for n, p in net.named_parameters()},
        state=_state_snapshot(opt),
        batches=watcher.records,
        grads=grads,
        clip_seen=clip_seen,
    )


# --------------------------------------------------------------------------------------------------------------------
# the Lightning side
# --------------------------------------------------------------------------------------------------------------------


@functools.cache
def lightning_api(package: str) -> SimpleNamespace:
    """The classes of the fork (:data:`FORK`) or of the unpatched 2.6.6 (:data:`STOCK`, the negative controls)."""
    shared = shared_lightning_api(package)
    pl, MixedPrecision = shared.pl, shared.MixedPrecision

    class FusedModule(pl.LightningModule):
        def __init__(self, optimizer: str, fused: bool, clip: str, mode: str, inf_at: Optional[int]) -> None:
            super().__init__()
            self.net = make_net()
            self.optimizer_name, self.fused, self.clip, self.inf_at = optimizer, fused, clip, inf_at
            self.automatic_optimization = mode == "automatic"
            self.grads: list[dict[str, torch.Tensor]] = []

        def configure_optimizers(self):
            return make_optimizer(self.optimizer_name, self.net.parameters(), self.fused)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = loss_fn(self.net, x, y, batch_idx, self.inf_at)
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            if self.clip != "none":
                self.clip_gradients(
                    opt,
                    gradient_clip_val=CLIP_NORM if self.clip == "norm" else CLIP_VALUE,
                    gradient_clip_algorithm=self.clip,
                )
            opt.step()
            return None

        def on_before_optimizer_step(self, optimizer):
            self.grads.append(_grads(self.net))

    class Watcher(pl.Callback):
        def __init__(self, precision: str) -> None:
            self.precision = precision
            self.watcher: Optional[_BatchWatcher] = None

        def on_train_start(self, trainer, pl_module) -> None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.watcher = _BatchWatcher(
                pl_module.net, trainer.optimizers[0], scaler.get_scale if scaler is not None else (lambda: None)
            )

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.watcher.before()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.watcher.after()

    def make_trainer(precision: str, clip: str, mode: str, init_scale: float = INIT_SCALE, callbacks=()):
        kwargs: dict[str, Any] = {}
        if mode == "automatic" and clip != "none":
            kwargs["gradient_clip_val"] = CLIP_NORM if clip == "norm" else CLIP_VALUE
            kwargs["gradient_clip_algorithm"] = clip
        scaler = new_scaler(init_scale=init_scale) if uses_scaler(precision) else None
        return shared_make_trainer(shared, precision, scaler=scaler, callbacks=callbacks, **kwargs)

    return SimpleNamespace(
        pl=pl, MixedPrecision=MixedPrecision, FusedModule=FusedModule, Watcher=Watcher, make_trainer=make_trainer
    )


def lightning_run(
    optimizer: str,
    fused: bool,
    precision: str,
    clip: str,
    mode: str,
    inf_at: Any = "default",
    init_scale: float = INIT_SCALE,
    callbacks: tuple = (),
    package: str = FORK,
) -> Run:
    inf_at = inf_batch(precision) if inf_at == "default" else inf_at
    api = lightning_api(package)
    module = api.FusedModule(optimizer, fused, clip, mode, inf_at)
    watcher = api.Watcher(precision)
    trainer = api.make_trainer(precision, clip, mode, init_scale, callbacks=(*callbacks, watcher))
    # batch_size=None: the prebuilt batches come out as they are (a plain list would mean several dataloaders)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(make_batches(), batch_size=None))
    assert len(watcher.watcher.records) == N_BATCHES, "the trainer did not run every batch"
    return Run(
        params={n: p.detach().clone() for n, p in module.net.named_parameters()},
        state=_state_snapshot(trainer.optimizers[0]),
        batches=watcher.watcher.records,
        grads=module.grads,
    )


@functools.cache
def cached_lightning_run(optimizer: str, fused: bool, precision: str, clip: str, mode: str) -> Run:
    return lightning_run(optimizer, fused, precision, clip, mode)


@functools.cache
def cached_recipe_run(optimizer: str, fused: bool, precision: str, clip: str, mode: str) -> Run:
    return recipe_run(optimizer, fused, precision, clip, mode)


# --------------------------------------------------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------------------------------------------------


def ulp_of_scale(t: torch.Tensor) -> float:
    """The spacing of fp32 numbers at the magnitude of ``t``'s largest finite element (``2**-149`` if all zero)."""
    finite = t[torch.isfinite(t)]
    largest = finite.abs().max().item() if finite.numel() else 0.0
    return 2.0 ** (math.floor(math.log2(largest)) - 23) if largest > 0 else 2.0**-149


@dataclass(frozen=True)
class Tolerance:
    """Elementwise ``|actual - expected| <= ulps * ulp_of_scale(expected)``: at most ``ulps`` units in the last place
    of the tensor's largest element. It is an absolute tolerance sized to the tensor: an element that crossed zero
    keeps the rounding error it picked up while it was large, so a per-element relative tolerance would be wrong."""

    ulps: int


#: exact equality, bit for bit (``-0.0 == 0.0``; NaN equals NaN at the same place)
BITWISE = None


def tensors_close(a: torch.Tensor, b: torch.Tensor, tol: Optional[Tolerance]) -> tuple[bool, str]:
    """Whether ``a`` matches ``b``; non-finite values must sit at the same places and be the same (NaN == NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)}/{a.dtype} != {tuple(b.shape)}/{b.dtype}"
    fin_a, fin_b = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fin_a, fin_b):
        return False, "non-finite values at different places"
    na, nb = a[~fin_a], b[~fin_b]
    if not (torch.equal(na.isnan(), nb.isnan()) and torch.equal(na.nan_to_num(), nb.nan_to_num())):
        return False, "different non-finite values"
    fa, fb = a[fin_a], b[fin_b]
    if torch.equal(fa, fb):
        return True, ""
    diff = (fa - fb).abs().max().item()
    if tol is None:
        return False, f"not bitwise equal: max abs diff {diff:.3g}"
    unit = ulp_of_scale(b)
    if diff <= tol.ulps * unit:
        return True, ""
    return False, f"max abs diff {diff:.3g} = {diff / unit:.3g} ulps of the tensor's scale (tolerance {tol.ulps})"


def assert_params_match(actual: Run, expected: Run, tol: Optional[Tolerance]) -> None:
    assert actual.params.keys() == expected.params.keys()
    bad = {}
    for name, p in expected.params.items():
        ok, why = tensors_close(actual.params[name], p, tol)
        if not ok:
            bad[name] = why
    assert not bad, f"parameters differ: {bad}"


def assert_state_matches(actual: Run, expected: Run, tol: Optional[Tolerance]) -> None:
    assert [sorted(s) for s in actual.state] == [sorted(s) for s in expected.state], "optimizer state keys differ"
    for i, (sa, se) in enumerate(zip(actual.state, expected.state)):
        for key, ve in se.items():
            va = sa[key]
            if key == "step":
                # step counters are exact on every path: a skipped fused step must not count
                assert float(va) == float(ve), f"param {i}: step {float(va)} != {float(ve)}"
                continue
            ok, why = tensors_close(va, ve, tol)
            assert ok, f"optimizer state {key!r} of param {i} differs: {why}"


def assert_grads_match(actual: Run, expected: Run, tol: Optional[Tolerance], first_bitwise: bool = True) -> None:
    """Gradients where the step reads them, step by step. The first step's gradients come from identical weights, so
    they must be bitwise equal whatever ``tol`` says (``first_bitwise``)."""
    assert len(actual.grads) == len(expected.grads), f"{len(actual.grads)} != {len(expected.grads)} recorded steps"
    for step, (ga, ge) in enumerate(zip(actual.grads, expected.grads)):
        assert ga.keys() == ge.keys(), f"step {step}: gradients of {sorted(ga)} != {sorted(ge)}"
        for name in ge:
            ok, why = tensors_close(ga[name], ge[name], BITWISE if step == 0 and first_bitwise else tol)
            assert ok, f"gradient of {name} seen at step {step} differs: {why}"


def assert_trajectory_matches(actual: Run, expected: Run, state_changes: bool = True) -> None:
    assert actual.scales == expected.scales, f"scale trajectory {actual.scales} != {expected.scales}"
    assert actual.skipped == expected.skipped, f"skipped steps {actual.skipped} != {expected.skipped}"
    if state_changes:
        changed_a = [b.state_changed for b in actual.batches]
        changed_e = [b.state_changed for b in expected.batches]
        assert changed_a == changed_e, f"batches that changed the optimizer state: {changed_a} != {changed_e}"


def assert_runs_match(
    actual: Run, expected: Run, tol: Optional[Tolerance], grad_tol: Optional[Tolerance], state_changes: bool = True
) -> None:
    """Scale trajectory, skipped steps, batches that changed the optimizer state (unless ``state_changes=False``),
    gradients where the step read them, final parameters and optimizer state."""
    assert_trajectory_matches(actual, expected, state_changes)
    assert_grads_match(actual, expected, grad_tol)
    assert_params_match(actual, expected, tol)
    assert_state_matches(actual, expected, tol)


def assert_skips_exactly(run: Run, precision: str, inf_at: Optional[int], stateful: bool) -> None:
    """The injected inf skipped its step completely (weights and optimizer state untouched, scale halved); every other
    step updated the weights (and the state, for an optimizer that has one), and grew the scale."""
    for i, b in enumerate(run.batches):
        if i == inf_at:
            assert not b.params_changed, f"batch {i} (inf): the weights changed"
            assert not b.state_changed, f"batch {i} (inf): the optimizer state changed"
            assert b.scale_after == b.scale_before / 2, f"batch {i} (inf): scale {b.scale_before} -> {b.scale_after}"
        else:
            assert b.params_changed, f"batch {i}: the weights did not change"
            assert b.state_changed == stateful, f"batch {i}: optimizer state changed: {b.state_changed}"
            if uses_scaler(precision):
                assert b.scale_after == b.scale_before * 2, f"batch {i}: scale {b.scale_before} -> {b.scale_after}"
            else:
                assert b.scale_before is b.scale_after is None
    for p in run.params.values():
        assert torch.isfinite(p).all()


@contextlib.contextmanager
def uninitialised_memory_is_nan():
    """Make ``torch.empty*`` fill with NaN (deterministic mode), so reading uninitialised memory shows reliably."""
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)


def scale_exponents(run: Run) -> list[int]:
    return [int(math.log2(s)) for s in run.scales]
