"""The torch side of ``make gpu-check``: one part of the check per process, its rows appended to a JSON-lines file.

Usage (``gpu_check.py`` starts it, with ``tests/`` on ``PYTHONPATH`` for the oracle; by hand for one part)::

    PYTHONPATH=tests python benchmarks/gpu_check_parts.py reports --device cuda --out /tmp/r.jsonl --deadline <time>
    PYTHONPATH=tests python benchmarks/gpu_check_parts.py cost --device cpu --dry-run --out /tmp/c.jsonl  # tiny, CPU

Parts (:data:`PARTS`), each row the fork, stock 2.6.6 and PyTorch's recipe side by side:

* ``reports``: the fused-Adam report (#15501): ``Adam(lr=1., fused=True)`` against ``fused=False``, ``precision=
  "16-mixed"``, 10 steps, automatic optimization, without and with ``gradient_clip_val=1``; a bf16-mixed
  manual-optimization run with an EMA teacher, a ``StepLR`` stepped per batch and a forward after the step.
* ``equivalence``: the CPU tests' loops on the device: manual norm clipping under 16-mixed, two optimizers fed by one
  backward, fused AdamW and fused SGD with ``gradient_clip_val``, the skip signal (``opt.step_was_skipped``), resume
  from the checkpoint after batch 3 against the uninterrupted run, ``FSDPPrecision`` with a ``ShardedGradScaler``
  (``strategy="fsdp"`` on one GPU; on the CPU the plugin alone, in a one-process gloo group).
* ``cost``: time per step, fork against stock in paired rounds, and host synchronisations per step
  (``torch.cuda.set_sync_debug_mode("warn")``; fork, stock, recipe), on ``workloads.py``'s MLP, 1,000-tensor model and
  transformer: bf16-mixed and 16-mixed, fused and foreach AdamW, a step-interval ``StepLR``.
* ``watch``: the opt-in misuse watch (``MixedPrecision(watch_misuse=True)``) on device parameters: two misuses caught,
  correct code (a reentrant activation checkpoint, two scaled backwards per step) raising nothing.

Every "Lightning equals the recipe" row goes through the tests' oracle (``tests/amp_oracle``): the recipe is its
``RecipeRun`` and its loops on the device, Lightning its ``fit_lightning`` (the fork is ``lightning``, stock the
unpatched ``stock_pytorch_lightning`` of ``make setup``), and a cell is what :func:`amp_oracle.run.differences` finds.
What is left here is the device's: the parts, the rows, timing and sync counting.

An exception in a row is that row's ``ERROR`` and the part goes on. Each record is one JSON line, written as soon as it
exists (``{"kind": "meta" | "row" | "progress" | "done", ...}``), so a part stopped at its deadline keeps its rows.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import logging
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from amp_oracle.loops import auto_plain, manual_clip, manual_plain, manual_two_optimizers, recipe_clip, recipe_plain
from amp_oracle.loops import recipe_two_optimizers
from amp_oracle.run import Run, RecipeRun, bitwise, differences
from amp_oracle.trainer import FORK, STOCK, fit_lightning, lightning_api, make_trainer, quiet_trainer
from amp_oracle import world as W
from torch import nn
from torch.utils.data import DataLoader
from workloads import build_batches, build_model, build_optimizer, build_scheduler, lightning_module, recipe_step

PARTS = ("reports", "equivalence", "cost", "watch")
#: largest absolute parameter difference from the recipe that still passes when a run is not bitwise equal (same
#: scale trajectory and skipped steps required): the order of a float32 rounding on these tiny models
TOLERANCE = 1e-5


# ---------------------------------------------------------------------------------------------------- records
class Part:
    """The records of one part: appended to ``out`` (JSON lines) as they are made."""

    def __init__(self, out: Path, device: str, dry_run: bool, deadline: float) -> None:
        self.out, self.device, self.dry_run, self.deadline = out, device, dry_run, deadline

    def emit(self, kind: str, **fields: Any) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")

    def time_left(self) -> float:
        return self.deadline - time.time()

    @contextlib.contextmanager
    def row(self, check: str) -> Iterator[dict[str, Any]]:
        """A row to fill in (``fork``, ``stock``, ``recipe``, ``verdict``, ``notes``, ``data``), emitted at the end;
        an exception inside becomes its ``ERROR`` verdict and does not leave the part."""
        row: dict[str, Any] = dict(check=check, fork="", stock="", recipe="", verdict="INFO", notes="", data={})
        try:
            yield row
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # pytest's skip (the stock copy absent) is a BaseException too
            row["verdict"], row["notes"] = "ERROR", short_error(err)
            row["data"]["traceback"] = traceback.format_exc()[-3000:]
        self.emit("row", **row)


def short_error(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def attempt(fn: Callable[[], Any]) -> tuple[Any, Optional[str]]:
    """``(fn(), None)``, or ``(None, "<error>")`` when it raises: a contender that fails is a cell, not a crash."""
    try:
        return fn(), None
    except KeyboardInterrupt:
        raise
    except BaseException as err:
        return None, short_error(err)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The Trainer's chatter about tiny runs (the oracle's list of it, and the device's) silenced."""
    with quiet_trainer(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(precision|GPU available|TPU|LOCAL_RANK|FSDP|sync_dist).*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


# ---------------------------------------------------------------------------------------------------- both sides
def on_device(loop: Callable, net: nn.Module, configure: Callable, precision: str, device: str, automatic: bool,
              **kwargs: Any) -> Run:
    """One of the oracle's recipe loops on ``device``, with the fork's autocast-cache policy for the mode."""
    rc = RecipeRun(copy.deepcopy(net), precision, W.AUTOCAST_CACHE and automatic, device=device, **kwargs)
    loop(rc, configure(rc.net))
    return rc.result()


def lightning_runs(precision: str, net: nn.Module, *args: Any, plugin: Optional[Callable[[str], Any]] = None,
                   **kwargs: Any) -> dict[str, tuple[Any, Optional[str]]]:
    """``fit_lightning`` of a copy of ``net`` through the fork and through stock (with ``plugin(package)``, if any,
    as the precision plugin): each its ``Run`` or its error."""

    def fit(package: str) -> Run:
        with quiet():
            extra = {"plugin": plugin(package)} if plugin else {}
            return fit_lightning(package, precision, copy.deepcopy(net), *args, **extra, **kwargs)

    return {"fork": attempt(lambda: fit(FORK)), "stock": attempt(lambda: fit(STOCK))}


def within_tolerance(actual: torch.Tensor, expected: torch.Tensor) -> Optional[str]:
    same = actual.dtype == expected.dtype and torch.allclose(actual, expected, rtol=0.0, atol=TOLERANCE)
    return None if same else bitwise(actual, expected)


def finite(actual: torch.Tensor, expected: torch.Tensor) -> Optional[str]:
    return None if torch.isfinite(actual).all() else "non-finite"


def judge(row: dict, expected: Optional[Run], runs: dict, recipe_error: Optional[str] = None,
          check: Callable = within_tolerance, records: bool = False) -> None:
    """The fork's and stock's cells against the recipe's run: ``bitwise``, or what ``differences`` finds; the verdict
    judges the fork: PASS when nothing differs under ``check`` (by default a parameter within :data:`TOLERANCE`)."""
    row["recipe"] = f"raises {recipe_error}" if recipe_error else row["recipe"] or "reference"
    for who, (run, error) in runs.items():
        if error is not None or expected is None:
            row[who], row["data"][who] = f"raises {error}" if error else "ran (the recipe failed)", {"error": error}
            continue
        found = differences(run, expected, records=records)
        passes = not differences(run, expected, records=records, check=check)
        text = "; ".join(found) or "bitwise"
        row[who] = text if len(text) < 300 else text[:297] + "..."
        row["data"][who] = {"differences": found, "passes": passes}
    row["verdict"] = "PASS" if row["data"].get("fork", {}).get("passes") else "FAIL"
    if row["verdict"] == "PASS" and row["data"]["fork"]["differences"]:
        row["notes"] = (row["notes"] + f" not bitwise, within {TOLERANCE:g}").strip()


def compare_row(part: Part, check: str, loop: Callable, step: Callable, configure: Callable, automatic: bool,
                precision: str = "16-mixed", net: Optional[nn.Module] = None, records: bool = False,
                **kwargs: Any) -> None:
    """A row: the oracle's recipe ``loop`` against ``step`` through the fork's and stock's Trainer, on the device."""
    net = W.mlp() if net is None else net
    with part.row(check) as row:
        expected, error = attempt(lambda: on_device(loop, net, configure, precision, part.device, automatic))
        runs = lightning_runs(precision, net, configure, step, automatic, device=part.device, **kwargs)
        judge(row, expected, runs, error, records=records)


# ---------------------------------------------------------------------------------------------------- 1. reports
def report_batches(n: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(15501)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 2, generator=g)) for _ in range(n)]


def report_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net(x).float(), y)


def part_reports(part: Part) -> None:
    fused_adam_rows(part)
    ema_row(part)


def fused_adam_rows(part: Part) -> None:
    device = part.device
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    for clip in (0.0, 1.0):
        recipes: dict[bool, Run] = {}
        for fused in (True, False):

            def configure(n: nn.Module) -> list:
                return [torch.optim.Adam(n.parameters(), lr=1.0, fused=fused)]

            def recipe(rc: RecipeRun, opts: list) -> None:
                # the report's loop by hand: torch's default scaler, unscale before the norm clip, step, update
                (opt,) = opts
                for _, (x, y) in rc.batches():
                    opt.zero_grad()
                    with rc.autocast():
                        loss = report_loss(rc.net, x, y)
                    rc.scaler.scale(loss).backward()
                    if clip:
                        rc.scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(rc.net.parameters(), clip)
                    rc.scaler.step(opt)
                    rc.scaler.update()

            what = f"fused-Adam report (#15501): Adam(lr=1., fused={fused}), 16-mixed, 10 steps, automatic" + (
                f", gradient_clip_val={clip:g}" if clip else ", no clipping")
            with part.row(what) as row:
                # the scaler the `precision` flag makes: torch's defaults
                scaler = W.new_scaler(device, init_scale=2.0**16, growth_interval=2000)
                expected, error = attempt(lambda: on_device(recipe, net, configure, "16-mixed", device, True,
                                                            scaler=scaler, data=report_batches()))
                runs = lightning_runs("16-mixed", net, configure, lambda m, b, i: report_loss(m.net, *b), True,
                                      scaler="lightning", loader=DataLoader(report_batches(), batch_size=None),
                                      device=device, gradient_clip_val=clip or None)
                judge(row, expected, runs, error)
                recipes[fused] = expected
                if expected is not None and recipes.get(not fused) is not None:
                    row["recipe"] += "; fused vs unfused recipe: " + (
                        "; ".join(differences(expected, recipes[not fused]))[:200] or "bitwise")
                if expected is not None:
                    row["data"]["recipe"] = {"scales": expected.scales, "changed": expected.changed}


def ema_row(part: Part) -> None:
    def ema_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s, t = net.student(x), net.teacher(x)
        return F.mse_loss(s.float(), y) + 0.5 * F.mse_loss(s.float(), t.float())

    def configure(net: nn.Module) -> tuple[list, list]:
        opt = W.make_optimizer("AdamW", W.trainable(net))
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

    def training_step(self: Any, batch: Any, batch_idx: int) -> None:
        opt, scheduler = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = ema_loss(self.net, x, y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        scheduler.step()
        self.net.update_teacher()
        # a forward after the step, in the same training_step: it must see the updated weights
        self.records.append(F.mse_loss(self.net.student(x).float(), y).item())

    def recipe(rc: RecipeRun, opts_and_schedulers: tuple[list, list]) -> None:
        (opt,), (scheduler,) = opts_and_schedulers
        for _, (x, y) in rc.batches():
            with rc.autocast():
                loss = ema_loss(rc.net, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            scheduler.step()
            rc.net.update_teacher()
            with rc.autocast():
                rc.records.append(F.mse_loss(rc.net.student(x).float(), y).item())

    compare_row(part, "bf16-mixed manual optimization: EMA teacher, StepLR stepped per batch, a forward after the "
                "step (records: its loss)", recipe, training_step, configure, False, "bf16-mixed", W.TeacherStudent(),
                records=True)


# ---------------------------------------------------------------------------------------------------- 2. equivalence
def resume_row(part: Part) -> None:
    """16-mixed, automatic, AdamW + step-interval StepLR, infs forced at two batches: a run resumed from the checkpoint
    after batch 3 ends bitwise where the uninterrupted run ends (parameters, scale, LR)."""
    device, total, resume_at, forced = part.device, 8, 3, (W.INF_BATCH, W.LATE_INF_BATCH)

    def step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        index = self.trainer.fit_loop.total_batch_idx  # data keyed by the global batch (restored on resume)
        x, y = (t.to(self.device) for t in W.trainer_batches()[index])
        return W.inject_inf(W.mlp_loss(self.net, x, y), index, forced)

    def configure(net: nn.Module) -> tuple[list, list]:
        opt = W.make_optimizer("AdamW", net.parameters())
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8), "interval": "step"}]

    def run(package: str) -> tuple[Run, Run]:
        api = lightning_api(package)
        out = []
        with tempfile.TemporaryDirectory() as tmp, quiet():
            for ckpt in (None, Path(tmp) / f"step={resume_at}.ckpt"):
                saver = [] if ckpt else [api.pl.callbacks.ModelCheckpoint(
                    dirpath=tmp, filename="{step}", every_n_train_steps=1, save_top_k=-1)]
                trainer = make_trainer(api, "16-mixed", W.new_scaler(device, init_scale=W.LOW_INIT_SCALE,
                                                                   growth_interval=2),
                                       callbacks=saver, device=device, enable_checkpointing=not ckpt, max_steps=total)
                module = api.RecipeModule(W.mlp(), configure, step, True, "16-mixed")
                trainer.fit(module, train_dataloaders=W.Positions(total), ckpt_path=ckpt and str(ckpt))
                lr = trainer.optimizers[0].param_groups[0]["lr"]
                out.append(Run({n: p.cpu() for n, p in W.named_params(module.net).items()},
                               [trainer.precision_plugin.scaler.get_scale()], [], records=[lr]))
        return out[1], out[0]

    with part.row(f"resume: 16-mixed automatic, AdamW + StepLR, infs at batches {forced}, resumed after batch "
                  f"{resume_at} of {total}, against the uninterrupted run (records: the LR)") as row:
        row["recipe"] = "the uninterrupted run of the same package"
        for who, (res, err) in {"fork": attempt(lambda: run(FORK)), "stock": attempt(lambda: run(STOCK))}.items():
            found = [f"raises {err}"] if err else differences(*res, records=True)
            row[who], row["data"][who] = "; ".join(found) or "bitwise", {"differences": found}
        row["verdict"] = "PASS" if row["fork"] == "bitwise" else "FAIL"


def fsdp_row(part: Part) -> None:
    """``FSDPPrecision("16-mixed", scaler=ShardedGradScaler(...))``: two optimizers fed by one backward, value clipping.
    On CUDA through ``strategy="fsdp"`` on one GPU: FSDP computes in fp16 parameters, so PASS needs the recipe's scale
    trajectory and skipped steps and finite weights (the parameters' difference is in the cell); on the CPU the plugin
    in a one-device Trainer with a one-process gloo group, as the CPU tests do, without autocast (``FSDPPrecision``
    autocasts on CUDA only), bitwise."""
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    device = part.device

    def recipe(rc: RecipeRun, opts: list) -> None:
        rc.dtype = rc.dtype if device == "cuda" else None
        for i, (x, y) in rc.batches():
            for opt in opts:
                opt.zero_grad()
            with rc.autocast():
                loss = rc.inject(W.mlp_loss(rc.net, x, y), i)
            rc.scaler.scale(loss).backward()
            for opt in opts:
                rc.scaler.unscale_(opt)
                torch.nn.utils.clip_grad_value_(W.optimizer_params(opt), W.CLIP_VALUE)
            for opt in opts:
                rc.scaler.step(opt)
            rc.scaler.update()

    def step(self: Any, batch: Any, batch_idx: int) -> None:
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(W.inject_inf(W.mlp_loss(self.net, *batch), batch_idx, self.inf_at))
        for opt in opts:
            self.clip_gradients(opt, gradient_clip_val=W.CLIP_VALUE, gradient_clip_algorithm="value")
        for opt in opts:
            opt.step()

    def plugin(package: str) -> Any:
        precision = __import__(f"{lightning_api(package).pl.__name__}.plugins.precision", fromlist=["FSDPPrecision"])
        return precision.FSDPPrecision("16-mixed", scaler=ShardedGradScaler(device, init_scale=W.INIT_SCALE,
                                                                             growth_interval=1))

    def configure(net: nn.Module) -> list:
        return W.two_optimizers(net, "AdamW")

    with part.row("FSDPPrecision('16-mixed', scaler=ShardedGradScaler(...)), two optimizers, one backward, manual "
                  "value clipping" + (", strategy='fsdp' on one GPU" if device == "cuda" else
                                      " (CPU: one-device Trainer, gloo group)")) as row:
        if device != "cuda" and not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
            dist.init_process_group("gloo", rank=0, world_size=1)
        expected, error = attempt(lambda: on_device(recipe, W.mlp(), configure, "16-mixed", device, False))
        strategy = {"strategy": "fsdp"} if device == "cuda" else {}
        runs = lightning_runs("16-mixed", W.mlp(), configure, step, False, plugin=plugin, device=device, **strategy)
        if dist.is_initialized():  # ours (CPU) or the FSDP strategy's (CUDA): a group left at exit can hang it
            dist.destroy_process_group()
        judge(row, expected, runs, error, check=finite if device == "cuda" else within_tolerance)


def part_equivalence(part: Part) -> None:
    adamw = lambda n: W.one_optimizer(n, "AdamW")  # noqa: E731
    compare_row(part, "manual optimization, 16-mixed: self.clip_gradients(opt, norm) clips unscaled gradients (#18089)",
                recipe_clip("norm"), manual_clip("norm"), adamw, automatic=False)
    compare_row(part, "manual optimization, 16-mixed: two optimizers fed by one backward, one scaler update per "
                "iteration", recipe_two_optimizers, manual_two_optimizers, lambda n: W.two_optimizers(n, "AdamW"), False)
    fused = {
        "AdamW(fused=True)": lambda n: [torch.optim.AdamW(W.trainable(n), lr=1e-2, fused=True)],
        "SGD(momentum=0.9, fused=True)": lambda n: [torch.optim.SGD(W.trainable(n), lr=0.1, momentum=0.9, fused=True)],
    }
    for name, configure in fused.items():
        compare_row(part, f"automatic optimization, 16-mixed: {name} with gradient_clip_val (#15501)",
                    recipe_clip("norm"), auto_plain, configure, True, gradient_clip_val=W.CLIP_NORM)

    def skip_step(self: Any, batch: Any, batch_idx: int) -> None:
        manual_plain(self, batch, batch_idx)
        self.records.append(getattr(self.optimizers(), "step_was_skipped", "absent"))

    for name, configure in {"AdamW": adamw, "AdamW(fused=True)": fused["AdamW(fused=True)"]}.items():
        with part.row(f"skip signal: opt.step_was_skipped after each manual {name} step, inf at batch {W.INF_BATCH} "
                      "(skipped per batch: the recipe's unchanged weights)") as row:
            expected, error = attempt(lambda: on_device(recipe_plain, W.mlp(), configure, "16-mixed", part.device, False))
            runs = lightning_runs("16-mixed", W.mlp(), configure, skip_step, False, device=part.device)
            for run, _ in runs.values():
                if run is not None:
                    run.skipped = [(signal,) for signal in run.records]
            if expected is not None:
                expected.skipped = [(not changed,) for changed in expected.changed]
            judge(row, expected, runs, error)
    resume_row(part)
    fsdp_row(part)


# ---------------------------------------------------------------------------------------------------- 3. cost
#: the cost part's sizes: (CUDA, dry run on the CPU)
COST_SIZES = {
    False: {"mlp_width": 256, "mlp_depth": 4, "mlp_batch": 256, "many_width": 8, "many_layers": 500,
            "many_batch": 64, "transformer_d": 256, "transformer_layers": 2, "transformer_seq": 64,
            "transformer_batch": 32},
    True: {"mlp_width": 16, "mlp_depth": 4, "mlp_batch": 4, "many_width": 4, "many_layers": 10, "many_batch": 4,
           "transformer_d": 16, "transformer_layers": 1, "transformer_seq": 4, "transformer_batch": 2},
}


@dataclass(frozen=True)
class CostCell:
    model: str  # a workload of workloads.py: "mlp", "many", "transformer"
    precision: str
    fused: bool
    automatic: bool = True

    def name(self, s: dict) -> str:
        """The row's label, with the model's sizes (the dry run's are tiny)."""
        model = {"mlp": f"{s['mlp_depth']} x {s['mlp_width']} MLP",
                 "many": f"{2 * s['many_layers']}-parameter-tensor model",
                 "transformer": f"{s['transformer_layers']}-layer transformer (d={s['transformer_d']}, seq "
                                f"{s['transformer_seq']})"}[self.model]
        return (f"{model}, {self.precision} {'fused' if self.fused else 'foreach'} AdamW + StepLR, "
                f"{'automatic' if self.automatic else 'manual'}")


def cost_cells(dry_run: bool) -> list[CostCell]:
    if dry_run:
        return [CostCell("mlp", "16-mixed", True), CostCell("transformer", "bf16-mixed", False),
                CostCell("many", "16-mixed", False, automatic=False)]
    cells = [CostCell(m, p, f) for m in ("mlp", "many", "transformer") for p in ("bf16-mixed", "16-mixed")
             for f in (True, False)]
    # manual optimization under 16-mixed: where the misuse watch, switched on, adds per-parameter hooks
    return cells + [CostCell(m, "16-mixed", False, automatic=False) for m in ("mlp", "many")]


class StepMarks:
    """Marks at the start of each iteration: times (device-synchronised first) or, with ``syncs``, host
    synchronisations over iterations ``warmup`` to ``warmup + steps``, counted with ``torch.cuda.set_sync_debug_mode
    ("warn")`` (torch warns at every synchronising CUDA call: ``.item()``, a device-to-host copy, ``nonzero``...; not
    at ``torch.cuda.synchronize()`` itself; a CPU run counts none)."""

    def __init__(self, device: str, warmup: int, steps: int, syncs: bool) -> None:
        self.device, self.warmup, self.steps, self.syncs = device, warmup, steps, syncs
        self.times: list[float] = []
        self.caught: Optional[contextlib.ExitStack] = None
        self.count, self.k = 0, 0

    def _count(self, on: bool) -> None:
        if on:
            self.caught = contextlib.ExitStack()
            self._warnings = self.caught.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn" if on else 0)
        if not on and self.caught is not None:
            self.count = sum("synchroniz" in str(w.message) for w in self._warnings)
            self.caught.close()
            self.caught = None

    def mark(self) -> None:
        if self.syncs:
            if self.k in (self.warmup, self.warmup + self.steps):
                self._count(self.k == self.warmup)
        else:
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
        self.k += 1

    def result(self) -> float:
        """Median seconds per step after warm-up, or host synchronisations per step."""
        if self.syncs:
            self._count(False)
            return self.count / self.steps
        return statistics.median([b - a for a, b in zip(self.times, self.times[1:])][self.warmup:])


def cost_run(who: str, cell: CostCell, sizes: dict, device: str, warmup: int, steps: int, syncs: bool) -> float:
    """One run of ``cell`` by ``who`` (``fork``, ``stock`` or ``recipe``): seconds per step, or host syncs per step."""
    torch.manual_seed(0)
    model = build_model(cell.model, sizes).to(device)
    batches = build_batches(cell.model, sizes, device, count=4)
    total = warmup + steps + 1
    marks = StepMarks(device, warmup, steps, syncs)
    # one moderate scale for every contender (as `make bench`): no measured step skips
    scaler = W.new_scaler(device, growth_interval=2000) if W.uses_scaler(cell.precision) else None
    if who == "recipe":
        opt = build_optimizer(model.parameters(), cell.fused, foreach=True)
        scheduler = build_scheduler(opt)
        for i in range(total):
            marks.mark()
            recipe_step(model, opt, scaler, *batches[i % len(batches)], device, W.autocast_dtype(cell.precision), 0.0)
            scheduler.step()
        marks.mark()
        return marks.result()
    api = lightning_api(FORK if who == "fork" else STOCK)

    class Marks(api.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            marks.mark()

    module = lightning_module(api.pl, model, "auto" if cell.automatic else "manual", cell.fused, foreach=True,
                              scheduler=True)
    trainer = make_trainer(api, cell.precision, scaler, callbacks=[Marks()], device=device, max_steps=total)
    with quiet():
        trainer.fit(module, DataLoader([batches[i % len(batches)] for i in range(total + 1)], batch_size=None))
    return marks.result()


def part_cost(part: Part) -> None:
    device, dry = part.device, part.dry_run
    sizes = COST_SIZES[dry]
    warmup, steps = (1, 3) if dry else (5, 20)
    cells = cost_cells(dry)
    who_all = ("fork", "stock", "recipe")
    for cell in cells:  # host synchronisations per step: one short run per contender and cell
        with part.row(f"host syncs per step: {cell.name(sizes)}") as row:
            counts = {}
            for who in who_all:
                counts[who], err = attempt(lambda: cost_run(who, cell, sizes, device, 1 if dry else 3,
                                                            2 if dry else 5, syncs=True))
                row[who] = f"raises {err}" if err else f"{counts[who]:.2f}"
                row["data"][who] = {"error": err} if err else {"syncs_per_step": counts[who]}
            if device != "cuda":
                row["notes"] = "not counted on a CPU"
            elif None not in counts.values():
                row["notes"] = (f"5 steps after 3; fork - stock {counts['fork'] - counts['stock']:+.2f}, "
                                f"fork - recipe {counts['fork'] - counts['recipe']:+.2f} per step")
    # time per step: paired rounds, fork and stock back to back (order alternating), the recipe beside them
    times: dict[tuple[CostCell, str], list[float]] = {}
    errors: dict[tuple[CostCell, str], str] = {}
    max_rounds, round_s, r = (1 if dry else 9), 0.0, 0
    while r < max_rounds and (r == 0 or part.time_left() > 1.3 * round_s + 5):
        started = time.time()
        for cell in cells:
            if r and part.time_left() < 5:
                break  # a late round stops short: its cells so far count, the others keep their earlier rounds
            for who in who_all if r % 2 == 0 else ("stock", "fork", "recipe"):
                if (cell, who) not in errors:
                    value, err = attempt(lambda: cost_run(who, cell, sizes, device, warmup, steps, syncs=False))
                    if err:
                        errors[(cell, who)] = err
                    else:
                        times.setdefault((cell, who), []).append(value)
        round_s, r = time.time() - started, r + 1
        part.emit("progress", rounds=r, round_s=round_s)
    for cell in cells:
        with part.row(f"time per step: {cell.name(sizes)}") as row:
            for who in who_all:
                t = times.get((cell, who), [])
                row[who] = f"raises {errors[(cell, who)]}" if (cell, who) in errors else (
                    f"{statistics.median(t) * 1e3:.3f} ms" if t else "-")
                row["data"][who] = {"step_s": t, "error": errors.get((cell, who))}
            ratios = [f / s for f, s in zip(times.get((cell, "fork"), []), times.get((cell, "stock"), []))]
            if ratios:  # paired: the same round
                row["fork"] += f"; fork/stock {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
                row["data"]["fork_over_stock"] = ratios
            row["notes"] = (f"median of {len(ratios)} paired rounds, {steps} steps after {warmup} warm-up, "
                            f"{'CUDA-synchronised' if device == 'cuda' else 'CPU'}")


# ---------------------------------------------------------------------------------------------------- 4. the watch
def misuse_plain_backward(self: Any, batch: Any, batch_idx: int) -> None:
    """A scaled backward and ``loss.backward()`` into the same gradients: the second one is not scaled."""
    opt = self.optimizers()
    opt.zero_grad()
    self.manual_backward(W.mlp_loss(self.net, *batch))
    W.mlp_loss(self.net, *batch).backward()
    opt.step()


def misuse_raw_step(self: Any, batch: Any, batch_idx: int) -> None:
    """A step of the raw ``torch.optim`` optimizer on gradients still multiplied by the scale."""
    opt = self.optimizers()
    opt.zero_grad()
    self.manual_backward(W.mlp_loss(self.net, *batch))
    opt.optimizer.step()


def correct_checkpointed(self: Any, batch: Any, batch_idx: int) -> None:
    """Correct code whose backward runs a nested backward: a reentrant activation checkpoint (on CUDA the engine's
    device thread runs the hooks). The reentrant form needs an input that requires grad to record its backward."""
    from torch.utils.checkpoint import checkpoint

    opt = self.optimizers()
    x, y = batch
    opt.zero_grad()
    self.manual_backward(F.mse_loss(checkpoint(self.net, x.detach().requires_grad_(), use_reentrant=True), y))
    opt.step()


def correct_two_backwards(self: Any, batch: Any, batch_idx: int) -> None:
    """Correct code: two scaled backwards into one set of gradients, two optimizers, several iterations."""
    opt_a, opt_b = self.optimizers()
    opt_a.zero_grad()
    opt_b.zero_grad()
    for xk, yk in W.chunks(*batch, 2):
        self.manual_backward(W.mlp_loss(self.net, xk, yk))
    opt_a.step()
    opt_b.step()


def part_watch(part: Part) -> None:
    rows = {  # check: (training_step, optimizers, whether it is a misuse the watch must catch)
        "misuse: loss.backward() mixed into scaled gradients (manual, 16-mixed)": (misuse_plain_backward, 1, True),
        "misuse: step of the raw optimizer on scaled gradients": (misuse_raw_step, 1, True),
        "correct code: reentrant activation checkpoint (nested backward on the engine's thread)":
            (correct_checkpointed, 1, False),
        "correct code: two scaled backwards per step, two optimizers, 8 iterations": (correct_two_backwards, 2, False),
    }
    for check, (step, n_opts, misuse) in rows.items():
        with part.row(check) as row:
            configure = functools.partial(W.one_optimizer if n_opts == 1 else W.two_optimizers, name="AdamW")
            runs = lightning_runs("16-mixed", W.mlp(), configure, step, False, device=part.device, watch_misuse=True)
            for who, (run, err) in runs.items():
                sane = run is not None and all(torch.isfinite(p).all().item() for p in run.params.values())
                row[who] = f"raises {err}" if err else "trains on" + ("" if sane else ", non-finite weights")
            caught, sane = runs["fork"][1] is not None, row["fork"] == "trains on"
            row["verdict"] = "PASS" if (caught if misuse else sane) else "FAIL"
            row["recipe"], row["notes"] = "-", "the fork with MixedPrecision(watch_misuse=True); stock has no watch"


# ---------------------------------------------------------------------------------------------------- main
def versions() -> dict[str, str]:
    """torch, CUDA, the GPU, the fork, stock and Python versions, as far as this interpreter has them."""
    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    for key, module in (("fork", "lightning"), ("stock", STOCK)):
        try:
            out[key] = __import__(module).__version__
        except ImportError:
            out[key] = "absent"
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=PARTS + ("versions",))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes and one round (a pipeline check)")
    p.add_argument("--out", type=Path, required=True, help="JSON-lines file the records are appended to")
    p.add_argument("--deadline", type=float, default=None, help="unix time by which the part should end")
    args = p.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric", STOCK, "stock_lightning_fabric"):
        with contextlib.suppress(ImportError):
            __import__(name)  # its import sets its logger's level: silence it afterwards
        logging.getLogger(name).setLevel(logging.ERROR)  # "GPU available: ..." and tips, at every fit
    part = Part(args.out, args.device, args.dry_run, args.deadline or time.time() + 3600)
    if args.part == "versions" or (args.device == "cuda" and not torch.cuda.is_available()):
        part.emit("meta", versions=versions(), cuda_available=torch.cuda.is_available())
        if args.part != "versions":
            sys.exit(f"torch {torch.__version__} here sees no CUDA device")
        part.emit("done")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # the recipe and Lightning must run the same kernels
    {"reports": part_reports, "equivalence": part_equivalence, "cost": part_cost, "watch": part_watch}[args.part](part)
    part.emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
