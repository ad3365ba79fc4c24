"""The fused-optimizer cells (``plugins/precision/test_amp_fused.py``): what the matrix adds to the oracle.

A cell is ``(optimizer, fused, precision, clip, mode)``: the MLP trained over :data:`~amp_oracle.world.N_BATCHES` fixed
batches through the Trainer (:func:`lightning_run`) or PyTorch's AMP recipe (:func:`recipe_run`), each a
:class:`~amp_oracle.run.Run` with the gradients where the step reads them (Lightning: ``on_before_optimizer_step``),
the final optimizer state and the batches that changed it; the recipe's ``records`` hold what clipping saw (to prove
it clipped). The recipe always unscales (the hook sees true gradients); ``mode`` only decides where it records them.
A fused optimizer is compared with its for-loop twin within a :class:`Tolerance`, the ``check`` of
:func:`~amp_oracle.run.assert_same_run`.
"""

import contextlib
import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from amp_oracle.loops import clip_reference
from amp_oracle.run import RecipeRun, Run
from amp_oracle.trainer import FORK, fit_lightning, lightning_api
from amp_oracle.world import (
    INIT_SCALE,
    clip_args,
    inf_batch,
    inject_inf,
    make_batches,
    mlp,
    mlp_loss,
    new_scaler,
    one_optimizer,
    optimizer_params,
    same,
    uses_scaler,
)

OPTIMIZERS = ("Adam", "AdamW", "SGD-momentum", "SGD", "Adagrad")
CLIPS = ("none", "norm", "value")
MODES = ("automatic", "manual")
#: this module's seeds for the shared MLP and batches
NET_SEED, DATA_SEED = 7, 2024


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


def configure(optimizer: str, fused: bool) -> Callable[[nn.Module], list[torch.optim.Optimizer]]:
    """One optimizer of :data:`~amp_oracle.world.IMPL_OPTIMIZERS` (``fused=False``: its for-loop implementation), or
    ``"SelfUnscalingSGD"``."""
    if optimizer == "SelfUnscalingSGD":
        assert not fused
        return lambda net: [SelfUnscalingSGD(net.parameters(), lr=0.1, momentum=0.9, foreach=False)]
    return functools.partial(one_optimizer, name=optimizer, fused=fused)


def optimizer_state(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every parameter's optimizer state (``exp_avg``, ``step``, ``momentum_buffer``, ``sum``...), copied; torch < 2.2
    keeps ``momentum_buffer: None`` for SGD without momentum: no state."""
    return [
        {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in opt.state.get(p, {}).items()
            if v is not None
        }
        for p in optimizer_params(opt)
    ]


def grads_of(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def recipe_run(
    optimizer: str,
    fused: bool,
    precision: str,
    clip: str,
    mode: str,
    inf_at: Any = "default",
    init_scale: float = INIT_SCALE,
) -> Run:
    """PyTorch's AMP recipe, unscaling every step and clipping by ``clip``. It records the gradients where Lightning's
    hook sees them: before clipping in automatic optimization (the hook runs before the Trainer clips), after the
    user's ``clip_gradients`` in manual optimization (the hook runs inside ``opt.step()``)."""
    rc = RecipeRun(mlp(NET_SEED), precision, data=make_batches(seed=DATA_SEED), init_scale=init_scale)
    if inf_at != "default":
        rc.inf_at = inf_at
    (opt,) = configure(optimizer, fused)(rc.net)
    grads, changed = [], []
    for i, (x, y) in rc.batches():
        before = optimizer_state(opt)
        opt.zero_grad()
        with rc.autocast():
            loss = rc.inject(mlp_loss(rc.net, x, y), i)
        rc.scaler.scale(loss).backward()
        rc.scaler.unscale_(opt)
        if mode == "automatic":
            grads.append(grads_of(rc.net))
        if clip != "none":
            clip_reference(rc, opt, clip)
        if mode == "manual":
            grads.append(grads_of(rc.net))
        rc.scaler.step(opt)
        rc.scaler.update()
        changed.append(not same(before, optimizer_state(opt)))
    return replace(rc.result(), grads=grads, state=optimizer_state(opt), state_changed=changed)


@functools.cache
def _watch(package: str) -> type:
    class Watch(lightning_api(package).Callback):
        """Records the gradients in ``on_before_optimizer_step`` (after the test's own callbacks: it comes last) and,
        around every batch, whether the optimizer state changed."""

        def __init__(self) -> None:
            self.grads: list[dict[str, torch.Tensor]] = []
            self.state_changed: list[bool] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.opt = trainer.optimizers[0]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._before = optimizer_state(self.opt)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.state_changed.append(not same(self._before, optimizer_state(self.opt)))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.grads.append(grads_of(pl_module.net))

    return Watch


def training_step(clip: str, inf_at: Optional[int]) -> Callable:
    def step(self, batch, batch_idx):
        loss = inject_inf(mlp_loss(self.net, *batch), batch_idx, inf_at)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if clip != "none":
            self.clip_gradients(opt, **clip_args(clip))
        opt.step()
        return None

    return step


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
    net: Optional[nn.Module] = None,
) -> Run:
    """The cell through the Trainer of ``package``; ``net`` (default: a fresh MLP) lets a test look at it after an
    error."""
    inf_at = inf_batch(precision) if inf_at == "default" else inf_at
    watch = _watch(package)()
    kwargs = clip_args(clip) if mode == "automatic" and clip != "none" else {}
    run = fit_lightning(
        package,
        precision,
        mlp(NET_SEED) if net is None else net,
        configure(optimizer, fused),
        training_step(clip, inf_at),
        automatic=mode == "automatic",
        scaler=new_scaler(init_scale=init_scale) if uses_scaler(precision) else None,
        # batch_size=None: the prebuilt batches come out as they are
        loader=DataLoader(make_batches(seed=DATA_SEED), batch_size=None),
        callbacks=(*callbacks, watch),
        **kwargs,
    )
    return replace(run, grads=watch.grads, state=optimizer_state(watch.opt), state_changed=watch.state_changed)


@functools.cache
def cached_run(side: str, optimizer: str, fused: bool, precision: str, clip: str, mode: str) -> Run:
    """A matrix cell's run (``side``: ``"lightning"`` or ``"recipe"``), trained once though several tests compare it."""
    return {"lightning": lightning_run, "recipe": recipe_run}[side](optimizer, fused, precision, clip, mode)


def ulp_of_scale(t: torch.Tensor) -> float:
    """The spacing of fp32 numbers at the magnitude of ``t``'s largest finite element (``2**-149`` if all zero)."""
    finite = t[torch.isfinite(t)]
    largest = finite.abs().max().item() if finite.numel() else 0.0
    return 2.0 ** (math.floor(math.log2(largest)) - 23) if largest > 0 else 2.0**-149


@dataclass(frozen=True)
class Tolerance:
    """A ``check`` for :func:`~amp_oracle.run.assert_same_run`: elementwise ``|actual - expected| <= ulps *
    ulp_of_scale(expected)``, at most ``ulps`` units in the last place of the tensor's largest element. It is an
    absolute tolerance sized to the tensor: an element that crossed zero keeps the rounding error it picked up while
    it was large, so a per-element relative tolerance would be wrong. Non-finite values must sit at the same places and
    be the same (NaN equals NaN); 0-d tensors (step counters) must be equal exactly."""

    ulps: int

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
        if a.dim() == 0 and b.dim() == 0:
            return None if float(a) == float(b) else f"{float(a)} != {float(b)}"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"shape/dtype {tuple(a.shape)}/{a.dtype} != {tuple(b.shape)}/{b.dtype}"
        fin_a, fin_b = torch.isfinite(a), torch.isfinite(b)
        if not torch.equal(fin_a, fin_b):
            return "non-finite values at different places"
        na, nb = a[~fin_a], b[~fin_b]
        if not (torch.equal(na.isnan(), nb.isnan()) and torch.equal(na.nan_to_num(), nb.nan_to_num())):
            return "different non-finite values"
        fa, fb = a[fin_a], b[fin_b]
        diff = 0.0 if torch.equal(fa, fb) else (fa - fb).abs().max().item()
        if diff <= self.ulps * ulp_of_scale(b):
            return None
        unit = ulp_of_scale(b)
        return f"max abs diff {diff:.3g} = {diff / unit:.3g} ulps of the tensor's scale (tolerance {self.ulps})"


#: exact equality, bit for bit (``-0.0 == 0.0``; NaN equals NaN at the same place)
BITWISE = Tolerance(0)


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
