"""Machinery for the DDP mixed-precision tests (``strategies/test_ddp_amp_recipe.py``).

Shared by the test (which computes the single-process references) and by the script that trains through
``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` (``strategies/scripts/ddp_amp_recipe.py``): the cases, the
network, the data, the optimizers, and the two hand-written PyTorch AMP recipes every DDP run is compared with.

Data: :data:`N_BATCHES` global batches of :data:`GLOBAL_BATCH` samples; rank ``r`` of the 2 processes trains on the
half ``[r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)`` of each. Every rank's loss is the mean over its half and DDP averages
the gradients over the ranks, so the gradients are those of the mean loss over the global batch. The references are

* :func:`recipe_run` with ``split=False``: the single-process recipe on the global batch (one forward and backward
  over all 8 samples). The mathematics of DDP, but not its rounding: DDP sums the two halves' gradients after each
  was computed (and, under autocast, rounded to fp16/bf16) on its own, so this reference agrees only up to a
  tolerance (see the test);
* :func:`recipe_run` with ``split=True``: the same recipe computing, per batch, the two halves' scaled gradients with
  one backward each, accumulated in the fp32 ``.grad`` and halved, which is exactly the arithmetic of DDP with two
  ranks: each rank's gradient times 1/2, summed by the all-reduce (a sum of two floats does not depend on the order;
  halving commutes with rounding). This reference is bitwise.

Loss scales are powers of two with ``growth_interval=1``, from ``LOW_INIT_SCALE`` (the resumed case trains two
epochs); :data:`INF_BATCH`'s loss is multiplied by ``inf`` on the ranks a case says.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from amp_oracle.world import (
    CLIP_NORM,
    INF_BATCH,
    LOW_INIT_SCALE,
    N_BATCHES,
    autocast_dtype,
    changed_since,
    make_batches,
    mlp,
    named_params,
    new_scaler,
    optimizer_params,
    snapshot,
)
from tests_pytorch.helpers.amp_fused import make_optimizer
from torch import nn

WORLD_SIZE = 2
GLOBAL_BATCH = 8
LOCAL_BATCH = GLOBAL_BATCH // WORLD_SIZE


@dataclass(frozen=True)
class Case:
    name: str
    precision: str = "16-mixed"
    automatic: bool = False
    optimizer: str = "AdamW"
    fused: bool = False
    #: clip by norm (:data:`CLIP_NORM`): ``self.clip_gradients`` in manual, ``gradient_clip_val`` in automatic mode
    clip: bool = False
    #: two optimizers (one per linear layer) fed by one backward (manual mode)
    two_optimizers: bool = False
    #: ``(batch, ranks)``: the batches whose loss gets an ``inf``, on which ranks
    inf: tuple[tuple[int, tuple[int, ...]], ...] = ((INF_BATCH, (0, 1)),)
    epochs: int = 1
    #: train ``epochs - 1`` epochs, save a checkpoint, resume from it in a fresh Trainer (also runs uninterrupted)
    resume: bool = False

    def inf_ranks(self, batch_idx: int) -> tuple[int, ...]:
        return dict(self.inf).get(batch_idx, ())

    @property
    def uses_scaler(self) -> bool:
        return self.precision == "16-mixed"


CASES = {
    case.name: case
    for case in (
        # promise 3 under DDP: clip_gradients in manual mode clips unscaled gradients
        Case("manual-clip", clip=True),
        # promise 5: two optimizers from one backward, one update per iteration (SGD with momentum is not
        # scale-invariant, so an unscale with the wrong scale shows in the weights)
        Case("two-optimizers", optimizer="SGD-momentum", two_optimizers=True, clip=True),
        # promise 6: fused AdamW, unscaled through the scaler and clipped by the Trainer
        Case("fused-clip", automatic=True, fused=True, clip=True),
        Case("fused-clip-bf16", precision="bf16-mixed", automatic=True, fused=True, clip=True, inf=()),
        # promise 7: skipped steps, the first one included, an inf on both ranks and on one rank only
        Case("skips", optimizer="SGD-momentum", clip=True, inf=((0, (0, 1)), (3, (0, 1)), (4, (1,)))),
        # promise 9: resume from a checkpoint (at the epoch boundary) continues exactly
        Case("resume", fused=True, clip=True, epochs=2, resume=True),
    )
}
#: the cases also run through the unpatched ``stock_pytorch_lightning`` 2.6.6, as negative controls
STOCK_CASES = ("manual-clip", "two-optimizers")


def make_net(seed: int = 11) -> nn.Sequential:
    return mlp(seed)


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches(N_BATCHES, GLOBAL_BATCH, seed=77)


def local_batch(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return batch[0][part].clone(), batch[1][part].clone()


class RankBatches:
    """One rank's halves of the global batches, as a plain iterable (the Trainer then adds no sampler)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        return iter([local_batch(batch, self.rank) for batch in global_batches()])

    def __len__(self) -> int:
        return N_BATCHES


def make_optimizers(case: Case, net: nn.Sequential) -> list[torch.optim.Optimizer]:
    if case.two_optimizers:
        return [make_optimizer(case.optimizer, net[i].parameters(), case.fused) for i in (0, 2)]
    return [make_optimizer(case.optimizer, net.parameters(), case.fused)]


def autocast(precision: str) -> contextlib.AbstractContextManager:
    dtype = autocast_dtype(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


@dataclass
class Result:
    """What a run records: final parameters; per batch the scale after it and, per optimizer, whether its step was
    skipped (``None`` where the package has no skip signal)."""

    params: dict[str, torch.Tensor]
    scales: Optional[list[float]]
    skipped: list[tuple[Optional[bool], ...]]


def recipe_run(case: Case, split: bool) -> Result:
    """PyTorch's AMP recipe on the global batches, for ``case.epochs`` epochs. ``split=False``: one forward/backward
    over the global batch (mean loss). ``split=True``: one backward per rank's half, accumulated, then halved, as DDP
    averages them."""
    net = make_net()
    opts = make_optimizers(case, net)
    scaler = new_scaler(enabled=case.uses_scaler, init_scale=LOW_INIT_SCALE)
    scales: Optional[list[float]] = [] if case.uses_scaler else None
    skipped = []
    for _ in range(case.epochs):
        for batch_idx, batch in enumerate(global_batches()):
            for opt in opts:
                opt.zero_grad()
            parts = [local_batch(batch, rank) for rank in range(WORLD_SIZE)] if split else [batch]
            for rank, (x, y) in enumerate(parts):
                with autocast(case.precision):
                    loss = F.mse_loss(net(x), y)
                infs = case.inf_ranks(batch_idx)
                if (split and rank in infs) or (not split and infs):
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
            if split:
                for p in net.parameters():
                    p.grad.mul_(1 / WORLD_SIZE)
            row = []
            for opt in opts:
                params = optimizer_params(opt)
                before = snapshot(params)
                if case.clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
                scaler.step(opt)
                row.append(not changed_since(before, params))
            scaler.update()
            skipped.append(tuple(row))
            if scales is not None:
                scales.append(scaler.get_scale())
    return Result(named_params(net), scales, skipped)
