"""The DDP driver (``strategies/test_ddp_amp_recipe.py``): ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``
over gloo, and the two hand-written PyTorch AMP recipes every DDP run is compared with.

Rank ``r`` trains on the half ``[r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)`` of each global batch; DDP averages the
gradients, so they are those of the mean loss over the global batch. The references (:func:`recipe_run`):

* ``split=False``: one forward and backward over the global batch: DDP's mathematics, not its rounding (DDP sums the
  halves' gradients after each was rounded on its own), so it agrees only up to a tolerance;
* ``split=True``: one scaled backward per half, accumulated in the fp32 ``.grad`` and halved: exactly DDP's arithmetic
  with two ranks (a sum of two floats does not depend on the order; halving commutes with rounding), so bitwise.

Why a subprocess: Lightning's launcher re-runs the main script as the other rank, which a pytest process cannot be.
:func:`launch` runs ``python -m amp_oracle.ddp OUTDIR [--stock]`` once; its first ``fit`` starts rank 1 and every later
Trainer joins the same process group. Both ranks train every case in order and save each :class:`~amp_oracle.run.Run`
as ``OUTDIR/<package>-<run>-rank<r>.pt``; ``--stock`` adds the negative controls (``stock_pytorch_lightning`` 2.6.6).
"""

import os
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest
import torch

from amp_oracle.run import RecipeRun, Run
from amp_oracle.trainer import FORK, STOCK, lightning_api, make_trainer
from amp_oracle.world import (
    CLIP_NORM,
    INF_BATCH,
    LOW_INIT_SCALE,
    N_BATCHES,
    clip_args,
    make_batches,
    mlp,
    mlp_loss,
    new_scaler,
    one_optimizer,
    optimizer_params,
    two_optimizers,
    uses_scaler,
)

WORLD_SIZE = 2
GLOBAL_BATCH = 8
LOCAL_BATCH = GLOBAL_BATCH // WORLD_SIZE
NET_SEED = 11
#: the script takes ~15 s on 2 cores (process start-up dominates); this is the limit for a stuck collective
TIMEOUT = 300


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

    def configure(self, net: torch.nn.Sequential) -> list[torch.optim.Optimizer]:
        return (two_optimizers if self.two_optimizers else one_optimizer)(net, self.optimizer, self.fused)


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
#: every run the script records: the cases, and the resumed half of the resume case
RUNS = [*CASES, *(f"{name}-resumed" for name, case in CASES.items() if case.resume)]


def case_of(run: str) -> Case:
    return CASES[run.removesuffix("-resumed")]


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches(N_BATCHES, GLOBAL_BATCH, seed=77)


def local_batch(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return batch[0][part].clone(), batch[1][part].clone()


def recipe_run(case: Case, split: bool) -> Run:
    """PyTorch's AMP recipe on the global batches, for ``case.epochs`` epochs. ``split=False``: one forward/backward
    over the global batch (mean loss). ``split=True``: one backward per rank's half, accumulated, then halved, as DDP
    averages them. ``skipped`` is, per optimizer, whether its step left its parameters alone."""
    rc = RecipeRun(mlp(NET_SEED), case.precision, data=global_batches(), init_scale=LOW_INIT_SCALE)
    rc.tracked = opts = case.configure(rc.net)
    for _ in range(case.epochs):
        for batch_idx, batch in rc.batches():
            for opt in opts:
                opt.zero_grad()
            parts = [local_batch(batch, rank) for rank in range(WORLD_SIZE)] if split else [batch]
            for rank, (x, y) in enumerate(parts):
                with rc.autocast():
                    loss = mlp_loss(rc.net, x, y)
                infs = case.inf_ranks(batch_idx)
                if (split and rank in infs) or (not split and infs):
                    loss = loss * float("inf")
                rc.scaler.scale(loss).backward()
            if split:
                for p in rc.net.parameters():
                    p.grad.mul_(1 / WORLD_SIZE)
            for opt in opts:
                if case.clip:
                    rc.scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(optimizer_params(opt), CLIP_NORM)
                rc.scaler.step(opt)
            rc.scaler.update()
    run = rc.result()  # the optimizers' groups hold every parameter: the net changed if any of them did
    return replace(run, changed=[any(row) for row in run.changed])


# --------------------------------------------------------------------------------------------------------------------
# the Lightning side, run by every rank of ``python -m amp_oracle.ddp``
# --------------------------------------------------------------------------------------------------------------------


class RankBatches:
    """This rank's halves of the global batches, as a plain iterable (the Trainer then adds no sampler)."""

    def __iter__(self):
        rank = torch.distributed.get_rank()
        return iter([local_batch(batch, rank) for batch in global_batches()])

    def __len__(self) -> int:
        return N_BATCHES


def training_step(case: Case) -> Callable:
    def step(self, batch, batch_idx):
        loss = mlp_loss(self.net, *batch)
        if self.global_rank in case.inf_ranks(batch_idx):
            loss = loss * float("inf")
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            if case.clip:
                self.clip_gradients(opt, **clip_args("norm"))
            opt.step()
        return None

    return step


def fit(package: str, case: Case, epochs: int, seed: int = NET_SEED, ckpt_path=None):
    """One DDP fit; returns the trainer and its Run (the skip signal ``step_was_skipped`` per optimizer, ``None`` where
    the package has none)."""
    api = lightning_api(package)
    skipped: list[tuple] = []

    class SkipSignals(api.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            opts = pl_module.optimizers()
            opts = opts if isinstance(opts, list) else [opts]
            skipped.append(tuple(getattr(opt, "step_was_skipped", None) for opt in opts))

    module = api.RecipeModule(mlp(seed), case.configure, training_step(case), case.automatic, case.precision)
    recorder = api.Recorder()
    clip = clip_args("norm") if case.automatic and case.clip else {}
    trainer = make_trainer(
        api,
        case.precision,
        scaler=new_scaler(init_scale=LOW_INIT_SCALE) if uses_scaler(case.precision) else None,
        callbacks=[recorder, SkipSignals()],
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        use_distributed_sampler=False,
        **clip,
    )
    trainer.fit(module, train_dataloaders=RankBatches(), ckpt_path=ckpt_path)
    return trainer, recorder.run(module.net, skipped=skipped)


def run_case(package: str, case: Case, outdir: Path) -> None:
    trainer, run = fit(package, case, case.epochs)
    runs = {case.name: run}
    if case.resume:
        # the same training, interrupted after all but the last epoch and resumed by a fresh Trainer from the
        # checkpoint, into a network with other weights: everything must come from the checkpoint
        trainer, first = fit(package, case, case.epochs - 1)
        ckpt = outdir / f"{package}-{case.name}.ckpt"
        trainer.save_checkpoint(ckpt)
        _, second = fit(package, case, case.epochs, seed=99, ckpt_path=ckpt)
        runs[case.name + "-resumed"] = Run(
            params=second.params,
            scales=None if first.scales is None else first.scales + second.scales,
            changed=first.changed + second.changed,
            skipped=first.skipped + second.skipped,
        )
    for name, result in runs.items():
        torch.save(vars(result), outdir / f"{package}-{name}-rank{trainer.global_rank}.pt")


def main() -> None:
    outdir = Path(sys.argv[1])
    warnings.filterwarnings("ignore")
    # one intra-op thread per process: 2 processes share the 2 cores; tiny matmuls do not use more anyway
    torch.set_num_threads(1)
    for case in CASES.values():
        run_case(FORK, case, outdir)
    if "--stock" in sys.argv:
        for name in STOCK_CASES:
            run_case(STOCK, CASES[name], outdir)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        (outdir / "done").touch()


# --------------------------------------------------------------------------------------------------------------------
# the test's side
# --------------------------------------------------------------------------------------------------------------------


def launch(outdir: Path, stock: bool) -> Callable[..., Run]:
    """Train every case (and, with ``stock``, the negative controls) with 2 ranks; return ``load(package, run, rank=0)
    -> Run``."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    # this package's folder first on the path, for both ranks
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", __name__, str(outdir), *(["--stock"] if stock else [])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # rank 1 is its child: on a timeout, end both
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the DDP script did not finish in {TIMEOUT} s:\n{output[-5000:]}")
    assert proc.returncode == 0, output[-5000:]
    assert (outdir / "done").exists(), output[-5000:]

    def load(package: str, run: str, rank: int = 0) -> Run:
        data = torch.load(outdir / f"{package}-{run}-rank{rank}.pt", weights_only=True)
        return Run(**{**data, "skipped": [tuple(row) for row in data["skipped"]]})

    return load


if __name__ == "__main__":
    main()
