"""Machinery for the Fabric mixed-precision equivalence tests (``plugins/precision/test_amp_fabric_recipe.py``).

A cell (:class:`Cell`) trains a tiny MLP (8 -> 16 -> 4, fp32 parameters) over :data:`N_BATCHES` fixed batches twice:

* through a hand-written Fabric loop (:func:`fabric_run`): ``fabric.setup``, forward through the ``_FabricModule``,
  ``fabric.backward(loss)``, optionally ``fabric.clip_gradients`` (or the user's own ``scaler.unscale_`` first), then
  ``optimizer.step()`` for every optimizer; and
* through a hand-written loop following PyTorch's AMP recipe (:func:`recipe_run`, "Automatic Mixed Precision examples"
  in the torch docs): autocast around forward and loss only, ``scaler.scale(loss).backward()``, ``scaler.unscale_(opt)``
  before clipping, ``scaler.step(opt)`` for every optimizer and ``scaler.update()`` once per iteration, after the last
  step.

Both sides share only what a user writes once: network, data, optimizer construction. :func:`assert_same_run` then
compares every parameter bitwise, the scale that scaled each batch's loss, the scale after the last iteration, and per
batch and optimizer whether the step was skipped.

Loss scales are powers of two (scaling and unscaling are then exact in fp32, so the two loops are bitwise comparable)
and ``growth_interval=1`` (the scale moves on every update, so a missing, extra or misplaced ``update()`` shows in the
trajectory). Under 16-mixed the loss of batch :data:`INF_BATCH` is multiplied by ``inf``, so a skipped step and a
back-off happen at a known place. Clip values are small enough that every finite step really clips (the recipe
records what clipping saw and the tests assert it).

The Fabric side is built by :func:`fabric_api` from a package: the fork (``lightning.fabric``) or the unpatched Fabric
2.6.6, ``stock_lightning_fabric`` (the tests' stock-pytorch-lightning wheel: upstream's pytorch_lightning 2.6.6 wheel,
unpatched, renamed; the negative controls).
"""

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from amp_oracle.torch_features import GradScaler, optimizer
from amp_oracle.world import (
    CLIP_NORM,
    CLIP_VALUE,
    INF_BATCH,
    N_BATCHES,
    assert_params_bitwise,
    autocast_dtype,
    changed_since,
    inject_inf,
    mlp,
    named_params,
    new_scaler,
    optimizer_params,
    snapshot,
    uses_scaler,
)
from amp_oracle.world import make_batches as world_batches
from torch import nn

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
OPTIMIZERS = ("AdamW", "Adam", "SGD-momentum")
CLIPS = ("none", "norm", "value")
#: who unscales the gradients before clipping: Fabric (``clip_gradients``), Fabric twice (``clip_gradients`` called
#: twice), or the user with ``scaler.unscale_`` on the Fabric-wrapped optimizer / on ``optimizer.optimizer``
UNSCALERS = ("fabric", "clip-twice", "user-wrapper", "user-raw")


@dataclass(frozen=True)
class Cell:
    precision: str
    optimizer: str = "AdamW"
    fused: bool = False
    clip: str = "none"
    unscaler: str = "fabric"
    #: two optimizers (one per linear layer) fed by one backward
    two_optimizers: bool = False
    #: the user calls ``scaler.update()`` after the steps, following the recipe to the letter
    user_update: bool = False
    #: batches whose loss gets an ``inf`` (``None``: :data:`INF_BATCH` under 16-mixed, none otherwise)
    inf_at: Optional[tuple[int, ...]] = None

    @property
    def inf_batches(self) -> tuple[int, ...]:
        if self.inf_at is not None:
            return self.inf_at
        return (INF_BATCH,) if uses_scaler(self.precision) else ()

    @property
    def id(self) -> str:
        parts = [self.precision, self.optimizer + ("-fused" if self.fused else "")]
        if self.clip != "none":
            parts.append(f"clip-{self.clip}")
        if self.unscaler != "fabric":
            parts.append(self.unscaler)
        if self.two_optimizers:
            parts.append("two-optimizers")
        if self.user_update:
            parts.append("user-update")
        if self.inf_at is not None:
            parts.append("inf@" + ",".join(map(str, self.inf_at)))
        return "|".join(parts)


# --------------------------------------------------------------------------------------------------------------------
# what both sides share: network, data, optimizers, loss
# --------------------------------------------------------------------------------------------------------------------


def make_net(seed: int = 7) -> nn.Sequential:
    return mlp(seed)


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The shared batches (:data:`N_BATCHES` of them) with this module's seed."""
    return world_batches(seed=2025)


def make_optimizer(name: str, params: Any, fused: bool) -> torch.optim.Optimizer:
    """``fused=False`` is the for-loop implementation (``foreach=False`` spelled out)."""
    impl = {"fused": True} if fused else {"fused": False, "foreach": False}
    if name == "Adam":
        return optimizer(torch.optim.Adam, params, lr=1e-2, **impl)
    if name == "AdamW":
        return optimizer(torch.optim.AdamW, params, lr=1e-2, weight_decay=0.1, **impl)
    if name == "SGD-momentum":
        return optimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9, **impl)
    raise ValueError(name)


def make_optimizers(cell: Cell, net: nn.Sequential) -> list[torch.optim.Optimizer]:
    if cell.two_optimizers:
        return [make_optimizer(cell.optimizer, net[i].parameters(), cell.fused) for i in (0, 2)]
    return [make_optimizer(cell.optimizer, net.parameters(), cell.fused)]


# --------------------------------------------------------------------------------------------------------------------
# what a run records, and the comparison
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    params: dict[str, torch.Tensor]
    #: the scale that scaled each batch's loss (``None`` without a scaler)
    scales: Optional[list[float]]
    #: the scale after the last iteration's update (``None`` without a scaler)
    final_scale: Optional[float]
    #: per batch, per optimizer: was the step skipped (recipe: the optimizer's parameters did not change; Fabric:
    #: ``optimizer.step_was_skipped``, or ``None`` where the package has no such attribute)
    skipped: list[tuple[Optional[bool], ...]]
    #: per batch, per optimizer: did its parameters change
    changed: list[tuple[bool, ...]]
    #: per step, what clipping saw before clipping: the recipe records the total norm, or the max abs gradient; the
    #: Fabric loop the total norm ``fabric.clip_gradients`` returns
    clip_seen: list[float] = field(default_factory=list)


def assert_same_run(actual: Run, expected: Run) -> None:
    """The Fabric run (``actual``) equals the recipe's (``expected``): scales, skips, parameters bitwise."""
    assert actual.scales == expected.scales, f"scale per batch: {actual.scales} != recipe {expected.scales}"
    assert actual.final_scale == expected.final_scale, f"final scale {actual.final_scale} != {expected.final_scale}"
    assert actual.changed == expected.changed, f"changed per batch: {actual.changed} != recipe {expected.changed}"
    assert actual.skipped == expected.skipped, f"skipped per batch: {actual.skipped} != recipe {expected.skipped}"
    assert_params_bitwise(actual.params, expected.params)
    if actual.clip_seen:  # the total norms fabric.clip_gradients returned: the true (unscaled) gradients' norms
        assert len(actual.clip_seen) == len(expected.clip_seen)
        for a, e in zip(actual.clip_seen, expected.clip_seen):
            same = a == e or (math.isnan(a) and math.isnan(e))
            assert same, f"total norms {actual.clip_seen} != recipe {expected.clip_seen}"


def assert_recipe_is_sharp(recipe: Run, cell: Cell) -> None:
    """The reference exercises what the cell claims: every finite step clipped, the injected infs were skipped (and
    nothing else), the scale backed off and grew."""
    expected_skips = [tuple(i in cell.inf_batches for _ in row) for i, row in enumerate(recipe.skipped)]
    assert recipe.skipped == expected_skips
    finite = [s for s in recipe.clip_seen if math.isfinite(s)]
    n_steps = sum(len(row) for i, row in enumerate(recipe.skipped) if i not in cell.inf_batches)
    if cell.clip == "norm":
        assert len(finite) == n_steps, recipe.clip_seen
        assert all(s > CLIP_NORM for s in finite), recipe.clip_seen
    elif cell.clip == "value":
        assert len(finite) == n_steps, recipe.clip_seen
        assert all(s > CLIP_VALUE for s in finite), recipe.clip_seen
    if uses_scaler(cell.precision):
        trajectory = recipe.scales + [recipe.final_scale]
        ratios = {b / a for a, b in zip(trajectory, trajectory[1:])}
        assert ratios == {0.5, 2.0}, trajectory
    else:
        assert recipe.scales is None
    for value in recipe.params.values():
        assert torch.isfinite(value).all()


# --------------------------------------------------------------------------------------------------------------------
# the hand-written PyTorch AMP recipe
# --------------------------------------------------------------------------------------------------------------------


def _clip(cell: Cell, params: list[torch.Tensor], seen: list[float]) -> None:
    """Clip as the cell says. A ``clip-twice`` cell clips twice here too, after a single ``unscale_``: by value that
    changes nothing, but ``clip_grad_norm_`` divides by ``total_norm + 1e-6``, so a second norm clip scales the already
    clipped gradients by a factor just below 1. What must not happen twice is the unscaling."""
    if cell.unscaler == "clip-twice":
        _clip_once(cell, params, seen)
        _clip_once(cell, params, [])
    else:
        _clip_once(cell, params, seen)


def _clip_once(cell: Cell, params: list[torch.Tensor], seen: list[float]) -> None:
    if cell.clip == "norm":
        seen.append(torch.nn.utils.clip_grad_norm_(params, CLIP_NORM).item())
    elif cell.clip == "value":
        seen.append(max(p.grad.abs().max().item() for p in params))
        torch.nn.utils.clip_grad_value_(params, clip_value=CLIP_VALUE)


def recipe_run(cell: Cell, batches: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None) -> Run:
    """PyTorch's AMP recipe, written out, over ``batches`` (default: :func:`make_batches`); without a scaler (32,
    bf16-mixed) the scaler is disabled (``enabled=False``: ``scale`` and ``step`` pass through, ``unscale_`` and
    ``update`` do nothing), as the torch docs suggest for switching AMP off."""
    net = make_net()
    opts = make_optimizers(cell, net)
    dtype = autocast_dtype(cell.precision)
    scaler = new_scaler(enabled=uses_scaler(cell.precision))
    run = Run(params={}, scales=[] if scaler.is_enabled() else None, final_scale=None, skipped=[], changed=[])
    for batch_idx, (x, y) in enumerate(make_batches() if batches is None else batches):
        for opt in opts:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = F.mse_loss(net(x), y)
        loss = inject_inf(loss, batch_idx, cell.inf_batches)
        scaler.scale(loss).backward()
        if scaler.is_enabled():
            run.scales.append(scaler.get_scale())
        changed = []
        for opt in opts:
            params = optimizer_params(opt)
            before = snapshot(params)
            if cell.clip != "none":
                scaler.unscale_(opt)
                _clip(cell, params, run.clip_seen)
            scaler.step(opt)
            changed.append(changed_since(before, params))
        scaler.update()
        run.changed.append(tuple(changed))
        run.skipped.append(tuple(not c for c in changed))
    run.params = named_params(net)
    run.final_scale = scaler.get_scale() if scaler.is_enabled() else None
    return run


def cached_recipe_run(cell: Cell) -> Run:
    """The recipe of ``cell``, computed once: who unscales, and whether the user calls ``update()`` themselves, does
    not change what the recipe does (it unscales once and updates once), clipping twice does."""
    unscaler = "clip-twice" if cell.unscaler == "clip-twice" else "fabric"
    return _cached_recipe_run(dataclasses.replace(cell, unscaler=unscaler, user_update=False))


@functools.cache
def _cached_recipe_run(cell: Cell) -> Run:
    return recipe_run(cell)


# --------------------------------------------------------------------------------------------------------------------
# the Fabric side
# --------------------------------------------------------------------------------------------------------------------

PACKAGES = ("lightning", "stock_lightning_fabric")


@functools.cache
def fabric_api(package: str) -> SimpleNamespace:
    """Fabric of the fork (``lightning``) or the unpatched Fabric 2.6.6 (``stock_lightning_fabric``)."""
    if package == "lightning":
        from lightning.fabric import Fabric
        from lightning.fabric.plugins.precision import MixedPrecision
    elif package == "stock_lightning_fabric":
        pytest.importorskip(package, reason=f"the negative control needs the unpatched Fabric 2.6.6 as `{package}`")
        from stock_lightning_fabric import Fabric
        from stock_lightning_fabric.plugins.precision import MixedPrecision
    else:
        raise ValueError(package)
    return SimpleNamespace(Fabric=Fabric, MixedPrecision=MixedPrecision)


def make_fabric(
    precision: str, package: str = "lightning", scaler: Optional[GradScaler] = None, watch_misuse: bool = False
):
    """A one-device CPU Fabric. 16-mixed goes through an explicit ``MixedPrecision`` with a CPU ``GradScaler``
    of the test's own settings (initial scale, ``growth_interval``); stock Fabric's ``precision="16-mixed"`` on CPU
    would build a CUDA scaler, which disables itself. ``watch_misuse`` switches the fork's opt-in misuse watch on."""
    api = fabric_api(package)
    if uses_scaler(precision):
        watch = {"watch_misuse": True} if watch_misuse and package == "lightning" else {}
        plugin = api.MixedPrecision("16-mixed", "cpu", scaler=scaler if scaler is not None else new_scaler(), **watch)
        return api.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    assert scaler is None
    return api.Fabric(accelerator="cpu", devices=1, precision="32-true" if precision == "32" else precision)


def fabric_clip(fabric: Any, cell: Cell, model: Any, opt: Any) -> Optional[float]:
    """``fabric.clip_gradients`` as the cell says; returns the total norm the first norm clipping reports. By norm with
    ``error_if_nonfinite=False``: Fabric's default (``True``, stock behaviour, unlike the Trainer's clipping) raises on
    the injected-inf step, where the recipe lets ``clip_grad_norm_`` produce non-finite gradients that ``scaler.step``
    then skips."""
    norms = []
    for _ in range(2 if cell.unscaler == "clip-twice" else 1):
        if cell.clip == "norm":
            norms.append(fabric.clip_gradients(model, opt, max_norm=CLIP_NORM, error_if_nonfinite=False).item())
        elif cell.clip == "value":
            fabric.clip_gradients(model, opt, clip_val=CLIP_VALUE)
    return norms[0] if norms else None


class FabricLoop:
    """A hand-written Fabric training loop over a range of the fixed batches, recording what :class:`Run` holds."""

    def __init__(self, cell: Cell, package: str = "lightning", seed: int = 7, watch_misuse: bool = False) -> None:
        self.cell = cell
        self.scaler = new_scaler() if uses_scaler(cell.precision) else None
        self.fabric = make_fabric(cell.precision, package, scaler=self.scaler, watch_misuse=watch_misuse)
        net = make_net(seed)
        self.model, *self.opts = self.fabric.setup(net, *make_optimizers(cell, net))
        self.run = Run(params={}, scales=[] if self.scaler else None, final_scale=None, skipped=[], changed=[])

    @property
    def precision_plugin(self) -> Any:
        return self.fabric.strategy.precision

    def train(self, batches: range) -> "FabricLoop":
        all_batches = make_batches()
        cell, fabric, run = self.cell, self.fabric, self.run
        for batch_idx in batches:
            x, y = all_batches[batch_idx]
            for opt in self.opts:
                opt.zero_grad()
            loss = F.mse_loss(self.model(x), y)
            loss = inject_inf(loss, batch_idx, cell.inf_batches)
            fabric.backward(loss)
            if self.scaler is not None:
                run.scales.append(self.scaler.get_scale())
            changed, skipped = [], []
            for opt in self.opts:
                params = optimizer_params(opt)
                before = snapshot(params)
                if cell.unscaler == "user-wrapper":
                    self.scaler.unscale_(opt)
                elif cell.unscaler == "user-raw":
                    self.scaler.unscale_(opt.optimizer)
                norm = fabric_clip(fabric, cell, self.model, opt)
                if norm is not None:
                    run.clip_seen.append(norm)
                opt.step()
                changed.append(changed_since(before, params))
                skipped.append(getattr(opt, "step_was_skipped", None))
            if cell.user_update:
                self.scaler.update()
            run.changed.append(tuple(changed))
            run.skipped.append(tuple(skipped))
        return self

    def state(self, scaler_entry: str = "plugin") -> dict[str, Any]:
        """What to hand to ``fabric.save``/``fabric.load``: the model, the optimizer(s) and, as ``scaler_entry``
        says, the precision plugin (``"plugin"``), the bare ``GradScaler`` (``"scaler"``) or nothing (``"none"``)."""
        state: dict[str, Any] = {"model": self.model, "optimizer": self.opts[0]}
        for i, opt in enumerate(self.opts[1:], start=1):
            state[f"optimizer{i}"] = opt
        if scaler_entry == "plugin":
            state["precision"] = self.precision_plugin
        elif scaler_entry == "scaler":
            state["scaler"] = self.scaler
        else:
            assert scaler_entry == "none"
        return state

    def save(self, path: Path, scaler_entry: str = "plugin") -> None:
        self.fabric.save(path, self.state(scaler_entry))

    def load(self, path: Path, scaler_entry: str = "plugin") -> dict:
        return self.fabric.load(path, self.state(scaler_entry))

    def finish(self) -> Run:
        """The final parameters and the scale after the last iteration's update. The fork applies an iteration's
        update lazily (before the next ``fabric.backward()``); the plugin's ``state_dict()`` holds a pending one, as
        a save does, so it is what gives the scale after the last iteration."""
        self.run.params = named_params(self.model.module)
        if self.scaler is not None:
            self.run.final_scale = float(self.precision_plugin.state_dict()["scale"])
        return self.run


def fabric_run(cell: Cell, package: str = "lightning") -> Run:
    return FabricLoop(cell, package).train(range(N_BATCHES)).finish()


@functools.cache
def cached_fabric_run(cell: Cell, package: str = "lightning") -> Run:
    return fabric_run(cell, package)
