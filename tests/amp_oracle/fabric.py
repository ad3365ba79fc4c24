"""Fabric's side of the oracle: a hand-written Fabric loop (:class:`FabricLoop`) and the recipe it must equal, cell by
cell, each returning a :class:`~amp_oracle.run.Run`.

A :class:`Cell` trains ``mlp(NET_SEED)`` over the :data:`~amp_oracle.world.N_BATCHES` batches of
``make_batches(seed=DATA_SEED)`` through Fabric (:func:`fabric_run`: ``fabric.backward``, ``fabric.clip_gradients`` or
the user's own ``scaler.unscale_``, ``optimizer.step()``) and through PyTorch's AMP recipe (:func:`recipe_run`). Both
record per batch and optimizer whether its parameters changed and whether its step was skipped (Fabric:
``optimizer.step_was_skipped``, ``None`` where the package has none) and, in ``records``, what norm clipping returned
(the recipe also ``("value", max |grad|)``, for :func:`assert_cell_is_sharp`). The Fabric side is the fork's
(``lightning``) or the unpatched ``stock_lightning_fabric`` 2.6.6 (the negative controls).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from amp_oracle.loops import clip_reference
from amp_oracle.run import RecipeRun, Run, assert_recipe_is_sharp
from amp_oracle.torch_features import GradScaler
from amp_oracle.world import (
    CLIP_NORM,
    CLIP_VALUE,
    INF_BATCH,
    N_BATCHES,
    changed_since,
    inject_inf,
    make_batches,
    make_optimizer,
    mlp,
    mlp_loss,
    named_params,
    new_scaler,
    optimizer_params,
    snapshot,
    uses_scaler,
)

#: the seeds of the cells' network and batches
NET_SEED, DATA_SEED = 7, 2025
#: the optimizers of the cells, each fused or for-loop (``make_optimizer(name, params, fused)``)
OPTIMIZERS = ("AdamW", "Adam", "SGD-momentum")
CLIPS = ("none", "norm", "value")


@dataclass(frozen=True)
class Cell:
    precision: str
    optimizer: str = "AdamW"
    fused: bool = False
    clip: str = "none"
    #: who unscales before clipping: Fabric (``clip_gradients``), Fabric twice (``"clip-twice"``), or the user with
    #: ``scaler.unscale_`` on the Fabric-wrapped optimizer (``"user-wrapper"``) / on ``optimizer.optimizer``
    #: (``"user-raw"``)
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

    def optimizers(self, net: nn.Sequential) -> list[torch.optim.Optimizer]:
        groups = [net[0].parameters(), net[2].parameters()] if self.two_optimizers else [net.parameters()]
        return [make_optimizer(self.optimizer, params, self.fused) for params in groups]


def assert_cell_is_sharp(recipe: Run, cell: Cell) -> None:
    """The recipe exercises what the cell claims: :func:`~amp_oracle.run.assert_recipe_is_sharp`, the injected infs
    skipped (and nothing else), every finite step clipped."""
    assert_recipe_is_sharp(recipe, cell.precision)
    assert recipe.skipped == [tuple(i in cell.inf_batches for _ in row) for i, row in enumerate(recipe.skipped)]
    if cell.clip != "none":
        finite = [seen for _, seen in recipe.records if math.isfinite(seen)]
        n_steps = sum(len(row) for i, row in enumerate(recipe.skipped) if i not in cell.inf_batches)
        assert len(finite) == n_steps, recipe.records
        assert all(seen > (CLIP_NORM if cell.clip == "norm" else CLIP_VALUE) for seen in finite), recipe.records


def recipe_run(
    cell: Cell,
    data: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
    scaler: Optional[GradScaler] = None,
    first_step_only_at: Optional[int] = None,
) -> Run:
    """PyTorch's AMP recipe of ``cell`` over ``data`` (default: the cells' batches), with ``scaler`` (default:
    :func:`~amp_oracle.world.new_scaler`'s); at batch ``first_step_only_at`` only the first optimizer steps. Who
    unscales and the user's own ``update()`` change nothing here (the recipe unscales once and updates once); clipping
    twice clips twice after one ``unscale_`` (by value a no-op, by norm a factor just below 1)."""
    net = mlp(NET_SEED)
    opts = cell.optimizers(net)
    data = make_batches(seed=DATA_SEED) if data is None else data
    rc = RecipeRun(net, cell.precision, autocast_cache=True, scaler=scaler, data=data)
    rc.inf_at, rc.tracked = cell.inf_batches, opts
    for i, (x, y) in rc.batches():
        for opt in opts:
            opt.zero_grad()
        with rc.autocast():
            loss = mlp_loss(net, x, y)
        rc.scaler.scale(rc.inject(loss, i)).backward()
        for opt in opts[:1] if i == first_step_only_at else opts:
            if cell.clip != "none":
                rc.scaler.unscale_(opt)
                clip_reference(rc, opt, cell.clip)
                if cell.unscaler == "clip-twice":
                    clip_reference(rc, opt, cell.clip)
                    del rc.records[-1]  # what the second clip saw
            rc.scaler.step(opt)
        rc.scaler.update()
    return rc.result()


# --------------------------------------------------------------------------------------------------------------------
# the Fabric side
# --------------------------------------------------------------------------------------------------------------------


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


class FabricLoop:
    """A hand-written Fabric training loop over ranges of the cells' batches, recording what a :class:`Run` holds.

    ``fabric``: a Fabric of the caller's (its plugin's scaler is the one read), else :func:`make_fabric`'s with
    :func:`~amp_oracle.world.new_scaler`'s. The loop reads the scale after each ``fabric.backward`` (``scaled``: the
    scale that scaled the batch) and, at :meth:`finish`, the scale the next iteration would use: the Run's scale after
    each batch is the scale of the next, the last one ``precision.state_dict()``'s (the fork applies an iteration's
    update lazily, before the next ``fabric.backward()``; the plugin's ``state_dict()`` holds a pending one, as a save
    does). A run resumed from a checkpoint (:meth:`resumes`) thus records the scale it continued with.
    """

    def __init__(
        self,
        cell: Cell,
        package: str = "lightning",
        seed: int = NET_SEED,
        watch_misuse: bool = False,
        fabric: Any = None,
    ) -> None:
        self.cell = cell
        scaled = uses_scaler(cell.precision)
        if fabric is None:
            self.scaler = new_scaler() if scaled else None
            fabric = make_fabric(cell.precision, package, scaler=self.scaler, watch_misuse=watch_misuse)
        else:
            self.scaler = fabric.strategy.precision.scaler if scaled else None
        self.fabric = fabric
        net = mlp(seed)
        self.model, *self.opts = fabric.setup(net, *cell.optimizers(net))
        self.scaled: list[float] = []
        self.changed: list[tuple[bool, ...]] = []
        self.skipped: list[tuple[Optional[bool], ...]] = []
        self.records: list[Any] = []

    @property
    def precision_plugin(self) -> Any:
        return self.fabric.strategy.precision

    def clip(self, opt: Any) -> Optional[float]:
        """``fabric.clip_gradients`` as the cell says; returns the total norm the first norm clipping reports. By norm
        with ``error_if_nonfinite=False``: Fabric's default (``True``, stock behaviour, unlike the Trainer's clipping)
        raises on the injected-inf step, where the recipe lets ``clip_grad_norm_`` produce non-finite gradients that
        ``scaler.step`` then skips."""
        norms = []
        for _ in range(2 if self.cell.unscaler == "clip-twice" else 1):
            if self.cell.clip == "norm":
                norm = self.fabric.clip_gradients(self.model, opt, max_norm=CLIP_NORM, error_if_nonfinite=False)
                norms.append(norm.item())
            elif self.cell.clip == "value":
                self.fabric.clip_gradients(self.model, opt, clip_val=CLIP_VALUE)
        return norms[0] if norms else None

    def train(self, batches: range, before_step: Callable[[int, int], None] = lambda i, k: None) -> "FabricLoop":
        """Train on ``batches``; ``before_step(batch_idx, k)`` runs after the ``k``-th optimizer's clipping, before its
        step."""
        cell, fabric, data = self.cell, self.fabric, make_batches(seed=DATA_SEED)
        for batch_idx in batches:
            x, y = data[batch_idx]
            for opt in self.opts:
                opt.zero_grad()
            fabric.backward(inject_inf(mlp_loss(self.model, x, y), batch_idx, cell.inf_batches))
            if self.scaler is not None:
                self.scaled.append(self.scaler.get_scale())
            changed, skipped = [], []
            for k, opt in enumerate(self.opts):
                params = optimizer_params(opt)
                before = snapshot(params)
                if cell.unscaler == "user-wrapper":
                    self.scaler.unscale_(opt)
                elif cell.unscaler == "user-raw":
                    self.scaler.unscale_(opt.optimizer)
                norm = self.clip(opt)
                if norm is not None:
                    self.records.append(("norm", norm))
                before_step(batch_idx, k)
                opt.step()
                changed.append(changed_since(before, params))
                skipped.append(getattr(opt, "step_was_skipped", None))
            if cell.user_update:
                self.scaler.update()
            self.changed.append(tuple(changed))
            self.skipped.append(tuple(skipped))
        return self

    def resumes(self, first: "FabricLoop") -> "FabricLoop":
        """This loop continues ``first``'s run (from its checkpoint): it takes over what ``first`` recorded."""
        self.scaled, self.changed = first.scaled + self.scaled, first.changed + self.changed
        self.skipped, self.records = first.skipped + self.skipped, first.records + self.records
        return self

    def state(self, scaler_entry: str = "plugin") -> dict[str, Any]:
        """What to hand to ``fabric.save``/``fabric.load``: the model, the optimizer(s) and, as ``scaler_entry``
        says, the precision plugin (``"plugin"``), the bare ``GradScaler`` (``"scaler"``) or nothing (``"none"``)."""
        state: dict[str, Any] = {"model": self.model, **{f"optimizer{i or ''}": o for i, o in enumerate(self.opts)}}
        entry = {"plugin": {"precision": self.precision_plugin}, "scaler": {"scaler": self.scaler}, "none": {}}
        return {**state, **entry[scaler_entry]}

    def save(self, path: Path, scaler_entry: str = "plugin") -> None:
        self.fabric.save(path, self.state(scaler_entry))

    def load(self, path: Path, scaler_entry: str = "plugin") -> dict:
        return self.fabric.load(path, self.state(scaler_entry))

    def finish(self) -> Run:
        scales = None
        if self.scaler is not None:
            scales = self.scaled[1:] + [float(self.precision_plugin.state_dict()["scale"])]
        return Run(
            params=named_params(self.model.module),
            scales=scales,
            changed=list(self.changed),
            records=list(self.records),
            skipped=list(self.skipped),
        )


def fabric_run(cell: Cell, package: str = "lightning") -> Run:
    return FabricLoop(cell, package).train(range(N_BATCHES)).finish()
