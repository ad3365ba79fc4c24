"""The torch side of ``make gpu-check``: one part of the check per process, its rows appended to a JSON-lines file.

Usage (``gpu_check.py`` starts it; by hand for one part)::

    python benchmarks/gpu_check_parts.py reports --device cuda --out /tmp/reports.jsonl --deadline <unix time>
    python benchmarks/gpu_check_parts.py cost --device cpu --dry-run --out /tmp/cost.jsonl   # tiny sizes, on the CPU

Parts (:data:`PARTS`):

* ``reports``: the two user reports. The fused-Adam report (#15501): ``Adam(lr=1., fused=True)`` against
  ``fused=False``, 16-mixed through the ``precision`` flag on CUDA, 10 steps, automatic optimization, without and with
  ``gradient_clip_val``. A bf16-mixed manual-optimization run with an EMA teacher, a step scheduler and a forward after
  the step.
* ``equivalence``: the CPU tests' loops on the device: manual clipping under 16-mixed, one update per iteration with two
  optimizers, fused AdamW and fused SGD with clipping, the skip signal (``opt.step_was_skipped``), resume from a
  mid-run checkpoint, and ``FSDPPrecision`` with a ``ShardedGradScaler`` (the FSDP strategy on one GPU).
* ``cost``: time per training step, fork against stock in paired rounds, on the 4 x 256 MLP, the 1,000-parameter-tensor
  model and a small transformer (bf16-mixed and 16-mixed, fused and foreach AdamW, a step-interval ``StepLR``); host
  synchronisations per step counted with ``torch.cuda.set_sync_debug_mode("warn")`` (fork, stock, recipe).
* ``watch``: the misuse watch on device parameters, switched on the way this fork offers it (found by trying: on by
  default, a ``MixedPrecision`` argument, ``Trainer(detect_anomaly=True)``; none: ``N/A``): a real misuse is caught,
  correct code (a reentrant activation checkpoint, several backwards per step) raises nothing.

Each side of a comparison is written once and shared: the tests' hand-written recipe loops and ``training_step`` bodies
(``tests/tests_pytorch/helpers/amp_recipe.py``) run here on the device through :class:`DeviceRecipe`, the Lightning side
through the tests' ``lightning_api(package)``: the fork is ``lightning``, stock 2.6.6 the unpatched
``stock_pytorch_lightning`` that ``make setup`` installs beside it.

Every row is isolated: an exception in one becomes that row's ``ERROR`` verdict and the part goes on. Each record is
one JSON line, written as soon as it exists (``{"kind": "meta" | "row" | "done", ...}``; rows as described in
``gpu_check_report.py``), so a part stopped at its deadline keeps what it did.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import inspect
import json
import logging
import math
import os
import platform
import re
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
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from tests_fabric.helpers import amp_world as W  # noqa: E402  (the tests' tiny AMP world: constants, data, MLP)
from tests_pytorch.helpers import amp_recipe as H  # noqa: E402  (the tests' recipe loops and Lightning side)
from workloads import build_model  # noqa: E402  (the benchmark's MLP and many-small-layers models)

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
        row: dict[str, Any] = {"check": check, "fork": "", "stock": "", "recipe": "", "verdict": "INFO", "notes": "",
                               "data": {}}
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
    """The Trainer's chatter about tiny runs (and the tests' list of it) silenced."""
    with H.quiet_trainer(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(precision|GPU available|TPU|LOCAL_RANK|FSDP|sync_dist).*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


# ---------------------------------------------------------------------------------------------------- comparing
def compare(actual: H.RunResult, expected: H.RunResult) -> dict[str, Any]:
    """How ``actual`` differs from ``expected``: bitwise equality of every parameter, the largest absolute difference,
    and whether the scale trajectory, the per-batch "parameters changed" and the records agree."""
    diffs = [
        (actual.params[name].double() - p.double()).abs().max().item() if p.numel() else 0.0
        for name, p in expected.params.items()
    ]
    records_equal = len(actual.records) == len(expected.records) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(actual.records, expected.records)
    )
    return {
        "bitwise": all(torch.equal(actual.params[n], p) for n, p in expected.params.items()),
        "max_abs_diff": max(diffs, default=0.0),
        "same_scales": actual.scales == expected.scales,
        "same_changed": actual.changed == expected.changed,
        "records_equal": records_equal,
    }


def describe(cmp: dict[str, Any]) -> str:
    text = "bitwise" if cmp["bitwise"] else f"max abs diff {cmp['max_abs_diff']:.3g}"
    if not cmp["same_scales"]:
        text += ", scale trajectory differs"
    if not cmp["same_changed"]:
        text += ", skipped steps differ"
    return text


def passes(cmp: dict[str, Any]) -> bool:
    """The fork's criterion: the recipe's trajectory, and its parameters bitwise or within :data:`TOLERANCE`."""
    return cmp["same_scales"] and cmp["same_changed"] and (cmp["bitwise"] or cmp["max_abs_diff"] <= TOLERANCE)


def contender_cell(result: Any, error: Optional[str], expected: Optional[H.RunResult]) -> tuple[str, dict]:
    """A contender's cell against the recipe, and its data."""
    if error is not None:
        return f"raises {error}", {"error": error}
    if expected is None:
        return "ran (no recipe to compare with)", {}
    cmp = compare(result, expected)
    return describe(cmp), cmp


def fill_comparison(row: dict, expected: Optional[H.RunResult], runs: dict[str, tuple[Any, Optional[str]]],
                    recipe_error: Optional[str] = None) -> None:
    """The fork's and stock's cells of ``row`` against the recipe's run, and the fork's verdict."""
    row["recipe"] = f"raises {recipe_error}" if recipe_error else "reference"
    for who, (result, error) in runs.items():
        row[who], row["data"][who] = contender_cell(result, error, expected)
    fork = row["data"].get("fork", {})
    row["verdict"] = "PASS" if expected is not None and "bitwise" in fork and passes(fork) else "FAIL"
    if expected is not None and fork.get("bitwise") is False and row["verdict"] == "PASS":
        row["notes"] = (row["notes"] + f" not bitwise, within {TOLERANCE:g}").strip()


# ---------------------------------------------------------------------------------------------------- both sides
def make_scaler(device: str, **kwargs: Any) -> Any:
    """``torch.amp.GradScaler(device, ...)`` (before torch 2.3: CUDA's ``torch.cuda.amp.GradScaler``)."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device, **kwargs)
    return torch.cuda.amp.GradScaler(**kwargs)


def recipe_scaler(device: str) -> Any:
    """The tests' scaler settings on ``device``: power-of-two initial scale, growth after every clean step."""
    return make_scaler(device, init_scale=W.INIT_SCALE, growth_interval=1)


def recipe_after_forward(loss: torch.Tensor, optimizers: list, scaler: Optional[Any],
                         clip: Optional[Callable[[Any], None]] = None) -> None:
    """PyTorch's AMP recipe after the forward: ``scaler.scale(loss).backward()``, then for each optimizer
    ``scaler.unscale_`` and ``clip(opt)`` (with a clip), ``scaler.step`` for each, one ``scaler.update()``. Without a
    scaler (bf16-mixed): backward, clip, step."""
    if scaler is None:
        loss.backward()
        for opt in optimizers:
            if clip is not None:
                clip(opt)
            opt.step()
        return
    scaler.scale(loss).backward()
    if clip is not None:
        for opt in optimizers:
            scaler.unscale_(opt)
            clip(opt)
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()


class DeviceRecipe(H.RecipeRun):
    """The tests' hand-written recipe state (:class:`RecipeRun`), on ``device``: its autocast and scaler are that
    device's, its batches are moved there. The tests' recipe loops (``recipe_clip``, ``recipe_two_optimizers``...)
    run on it unchanged."""

    def __init__(self, net: nn.Module, precision: str, device: str, autocast_cache: bool,
                 scaler: Optional[Any] = None) -> None:
        super().__init__(net.to(device), precision, autocast_cache=autocast_cache)
        self.device = device
        enabled = W.uses_scaler(precision)
        self.scaler = scaler if scaler is not None else (
            recipe_scaler(device) if enabled else make_scaler(device, enabled=False))

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.dtype, cache_enabled=self.autocast_cache)

    def batches(self) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        params = H.trainable(self.net)
        batches = H.make_batches()
        for batch_idx in range(self.start, self.stop):
            x, y = batches[batch_idx]
            before = [p.detach().clone() for p in params]
            yield batch_idx, (x.to(self.device), y.to(self.device))
            self.changed.append(any(not torch.equal(b, p) for b, p in zip(before, params)))
            if W.uses_scaler(self.precision):
                self.scales.append(self.scaler.get_scale())

    def result(self) -> H.RunResult:
        out = super().result()
        out.params = {name: p.cpu() for name, p in out.params.items()}
        out.records = [r.cpu() if isinstance(r, torch.Tensor) else r for r in out.records]
        return out


def run_recipe(loop: Callable, net: nn.Module, configure: Callable, precision: str, device: str,
               automatic: bool) -> H.RunResult:
    """One of the tests' recipe loops on ``device``, with the fork's autocast-cache policy for the mode."""
    rc = DeviceRecipe(copy.deepcopy(net), precision, device, autocast_cache=H.AUTOCAST_CACHE and automatic)
    loop(rc, configure(rc.net))
    return rc.result()


def trainer_kwargs(api: Any, precision: str, device: str, scaler: Any = None, flag: bool = False) -> dict[str, Any]:
    """A one-device Trainer's arguments. 16-mixed goes through ``MixedPrecision`` with ``scaler`` (default: the tests'
    settings); with ``flag`` on CUDA through ``precision="16-mixed"`` as a user writes it (Lightning's own scaler)."""
    kwargs: dict[str, Any] = {
        "accelerator": "gpu" if device == "cuda" else "cpu", "devices": 1, "max_epochs": 1, "logger": False,
        "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    if precision == "16-mixed" and not (flag and device == "cuda"):
        kwargs["plugins"] = [api.MixedPrecision("16-mixed", device, scaler=scaler or recipe_scaler(device))]
    else:
        kwargs["precision"] = "32-true" if precision == "32" else precision
    return kwargs


class Loader:
    """Fixed CPU batches as a sized iterable (Lightning moves them to the device)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def fit(package: str, precision: str, device: str, net: nn.Module, configure: Callable, step: Callable,
        automatic: bool, scaler: Any = None, flag: bool = False, loader: Any = None, callbacks: tuple = (),
        **extra: Any) -> H.RunResult:
    """Train a copy of ``net`` for one epoch through the Trainer of ``package`` with the tests' ``RecipeModule``."""
    api = H.lightning_api(package)
    module = api.RecipeModule(copy.deepcopy(net), configure, step, automatic, precision)
    recorder = api.Recorder()
    kwargs = {**trainer_kwargs(api, precision, device, scaler, flag), **extra}
    trainer = api.Trainer(callbacks=[recorder, *callbacks], **kwargs)
    with quiet():
        trainer.fit(module, train_dataloaders=loader if loader is not None else H.Batches())
    return H.RunResult(
        params={name: p.detach().cpu().clone() for name, p in module.net.named_parameters()},
        scales=None if all(s is None for s in recorder.scales) else recorder.scales,
        changed=recorder.changed,
        records=[r.detach().cpu() if isinstance(r, torch.Tensor) else r for r in module.records],
    )


def fork_and_stock(run: Callable[[str], H.RunResult]) -> dict[str, tuple[Any, Optional[str]]]:
    return {"fork": attempt(lambda: run(H.FORK)), "stock": attempt(lambda: run(H.STOCK))}


# ---------------------------------------------------------------------------------------------------- 1. reports
def report_batches(n: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(15501)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 2, generator=g)) for _ in range(n)]


def report_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def report_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net(x).float(), y)


def recipe_fused_report(net: nn.Module, device: str, fused: bool, clip: float) -> H.RunResult:
    """The report's loop by hand: fp16 autocast around forward and loss, torch's default scaler, unscale before the
    norm clip, step, update."""
    net = copy.deepcopy(net).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1.0, fused=fused)
    scaler = make_scaler(device)
    scales, changed = [], []
    for x, y in report_batches():
        x, y = x.to(device), y.to(device)
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16, cache_enabled=H.AUTOCAST_CACHE):
            loss = report_loss(net, x, y)
        recipe_after_forward(loss, [opt], scaler,
                             (lambda o: torch.nn.utils.clip_grad_norm_(net.parameters(), clip)) if clip else None)
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, net.parameters())))
        scales.append(scaler.get_scale())
    return H.RunResult({n: p.detach().cpu().clone() for n, p in net.named_parameters()}, scales, changed)


def part_reports(part: Part) -> None:
    device = part.device
    net = report_net()

    def lightning_run(package: str, fused: bool, clip: float) -> H.RunResult:
        extra = {"gradient_clip_val": clip} if clip else {}
        return fit(package, "16-mixed", device, net,
                   lambda n: [torch.optim.Adam(n.parameters(), lr=1.0, fused=fused)],
                   lambda self, batch, i: report_loss(self.net, *batch), automatic=True,
                   scaler=make_scaler(device), flag=True, loader=Loader(report_batches()), **extra)

    recipes: dict[tuple[bool, float], H.RunResult] = {}
    for clip in (0.0, 1.0):
        for fused in (True, False):
            what = f"fused-Adam report (#15501): Adam(lr=1., fused={fused}), 16-mixed, 10 steps, automatic" + (
                f", gradient_clip_val={clip:g}" if clip else ", no clipping")
            with part.row(what) as row:
                expected, recipe_error = attempt(lambda: recipe_fused_report(net, device, fused, clip))
                recipes[(fused, clip)] = expected
                fill_comparison(row, expected, fork_and_stock(lambda p: lightning_run(p, fused, clip)), recipe_error)
                other = recipes.get((not fused, clip))
                if expected is not None and other is not None:
                    cmp = compare(expected, other)
                    row["recipe"] = f"reference; fused vs unfused recipe: {describe(cmp)}"
                    row["data"]["recipe_fused_vs_unfused"] = cmp
                if expected is not None:
                    row["data"]["skipped_batches"] = [i for i, c in enumerate(expected.changed) if not c]
                    row["data"]["scales"] = expected.scales
    with part.row("bf16-mixed manual optimization: EMA teacher, StepLR stepped per batch, a forward after the step") \
            as row:
        teacher = H.TeacherStudent()

        def configure(net: nn.Module) -> tuple[list, list]:
            opt = H.make_optimizer("AdamW", H.trainable(net))
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

        def ema_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            s, t = net.student(x), net.teacher(x)
            return F.mse_loss(s.float(), y) + 0.5 * F.mse_loss(s.float(), t.float())

        def training_step(self: Any, batch: Any, batch_idx: int) -> None:
            opt, scheduler = self.optimizers(), self.lr_schedulers()
            x, y = batch
            loss = ema_loss(self.net, x, y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            scheduler.step()
            self.net.update_teacher()
            # a forward after the step, in the same training_step: must see the updated weights (promise 2)
            self.records.append(F.mse_loss(self.net.student(x).float(), y).detach())

        def recipe(rc: H.RecipeRun, opts_and_schedulers: tuple[list, list]) -> None:
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
                    rc.records.append(F.mse_loss(rc.net.student(x).float(), y).detach())

        expected, recipe_error = attempt(lambda: run_recipe(recipe, teacher, configure, "bf16-mixed", device, False))
        runs = fork_and_stock(lambda p: fit(p, "bf16-mixed", device, teacher, configure, training_step, False))
        fill_comparison(row, expected, runs, recipe_error)
        for who, (result, _) in runs.items():
            if result is not None and expected is not None and not compare(result, expected)["records_equal"]:
                row[who] += "; forward after the step differs"
                if who == "fork":
                    row["verdict"] = "FAIL"


# ---------------------------------------------------------------------------------------------------- 2. equivalence
def resume_rows(part: Part) -> None:
    """16-mixed, automatic, AdamW + step-interval StepLR, infs forced at two batches: a run resumed from the checkpoint
    after batch 3 ends bitwise where the uninterrupted run ends (parameters, scale, LR)."""
    device, total, resume_at, forced = part.device, 8, 3, (2, 5)

    def batch_for(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 + index)
        return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)

    @functools.cache
    def module_class(package: str) -> type:
        pl = H.lightning_api(package).pl

        class Resume(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = W.mlp()

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                index = self.trainer.fit_loop.total_batch_idx  # data keyed by the global batch (restored on resume)
                x, y = (t.to(self.device) for t in batch_for(index))
                loss = W.mlp_loss(self.net, x, y)
                return loss * float("inf") if index in forced else loss

            def configure_optimizers(self) -> dict:
                opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
                return {"optimizer": opt, "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8), "interval": "step"}}

        return Resume

    def run(package: str) -> dict[str, Any]:
        api = H.lightning_api(package)
        ckpt_cls = api.pl.callbacks.ModelCheckpoint
        with tempfile.TemporaryDirectory() as tmp:
            def trainer(callbacks: list) -> Any:
                kwargs = trainer_kwargs(api, "16-mixed", device, scaler=make_scaler(device, init_scale=2.0**4,
                                                                                    growth_interval=2))
                kwargs.update(enable_checkpointing=bool(callbacks), max_steps=total, callbacks=callbacks)
                return api.Trainer(**kwargs)

            full = module_class(package)()
            saver = ckpt_cls(dirpath=tmp, every_n_train_steps=1, save_top_k=-1, filename="{step}")
            with quiet():
                t_full = trainer([saver])
                t_full.fit(full, train_dataloaders=H.Positions(total))
            ckpt = Path(tmp) / f"step={resume_at}.ckpt"
            if not ckpt.exists():
                raise RuntimeError(f"no checkpoint {ckpt.name} among {sorted(p.name for p in Path(tmp).iterdir())}")
            resumed = module_class(package)()
            with quiet():
                t_res = trainer([])
                t_res.fit(resumed, train_dataloaders=H.Positions(total), ckpt_path=str(ckpt))
            out = {}
            for name, (t, m) in {"full": (t_full, full), "resumed": (t_res, resumed)}.items():
                out[name] = {
                    "params": [p.detach().cpu().clone() for p in m.parameters()],
                    "scale": t.precision_plugin.scaler.get_scale(),
                    "lr": t.optimizers[0].param_groups[0]["lr"],
                }
            return out

    with part.row(f"resume: 16-mixed automatic, AdamW + StepLR, infs at batches {forced}, resumed after batch "
                  f"{resume_at} of {total}, against the uninterrupted run") as row:
        row["recipe"] = "the uninterrupted run of the same package"
        for who, (res, err) in fork_and_stock(run).items():
            if err is not None:
                row[who], row["data"][who] = f"raises {err}", {"error": err}
                continue
            full, resumed = res["full"], res["resumed"]
            bitwise = all(torch.equal(a, b) for a, b in zip(full["params"], resumed["params"]))
            diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(full["params"], resumed["params"]))
            same = bitwise and full["scale"] == resumed["scale"] and full["lr"] == resumed["lr"]
            row[who] = ("bitwise" if bitwise else f"max abs diff {diff:.3g}") + (
                "" if full["scale"] == resumed["scale"] else f", scale {resumed['scale']} vs {full['scale']}") + (
                "" if full["lr"] == resumed["lr"] else f", lr {resumed['lr']:.3g} vs {full['lr']:.3g}")
            row["data"][who] = {"bitwise": bitwise, "max_abs_diff": diff, "same_state": same,
                                "scale": [full["scale"], resumed["scale"]], "lr": [full["lr"], resumed["lr"]]}
        row["verdict"] = "PASS" if row["data"].get("fork", {}).get("same_state") else "FAIL"


def fsdp_rows(part: Part) -> None:
    """``FSDPPrecision("16-mixed", scaler=ShardedGradScaler(...))``: two optimizers fed by one backward, value clipping.
    On CUDA through ``strategy="fsdp"`` on one GPU (FSDP computes in fp16 parameters, so the comparison with the autocast
    recipe is the scale trajectory and skipped steps, and the measured parameter difference); on the CPU (dry run) the
    plugin in a one-device Trainer with a one-process gloo group, as the CPU tests do (bitwise there)."""
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    device, n_batches, inf_at, clip = part.device, 6, 2, 0.004
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n_batches)]

    def nets() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        return nn.Linear(8, 16), nn.Linear(16, 4)

    def optimizers(first: nn.Module, second: nn.Module) -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW(first.parameters(), lr=1e-2), torch.optim.SGD(second.parameters(), lr=0.1,
                                                                                momentum=0.9)]

    def loss_of(first: nn.Module, second: nn.Module, x: torch.Tensor, y: torch.Tensor, i: int) -> torch.Tensor:
        loss = F.mse_loss(second(torch.relu(first(x))).float(), y)
        return loss * float("inf") if i == inf_at else loss

    def recipe() -> tuple[list[torch.Tensor], list[float]]:
        first, second = (m.to(device) for m in nets())
        opts, scaler, scales = optimizers(first, second), recipe_scaler(device), []
        # FSDPPrecision autocasts on CUDA only (CUDA autocast does nothing to CPU tensors)
        ctx = (lambda: torch.autocast("cuda", dtype=torch.float16)) if device == "cuda" else contextlib.nullcontext
        for i, (x, y) in enumerate(data):
            x, y = x.to(device), y.to(device)
            for opt in opts:
                opt.zero_grad()
            with ctx():
                loss = loss_of(first, second, x, y, i)
            recipe_after_forward(loss, opts, scaler, lambda o: torch.nn.utils.clip_grad_value_(
                [q for group in o.param_groups for q in group["params"]], clip))
            scales.append(scaler.get_scale())
        return [p.detach().cpu().clone() for p in (*first.parameters(), *second.parameters())], scales

    def run(package: str) -> tuple[list[torch.Tensor], list[float]]:
        api = H.lightning_api(package)
        fsdp_precision = __import__(f"{api.pl.__name__}.plugins.precision", fromlist=["FSDPPrecision"]).FSDPPrecision
        scales: list[float] = []

        class Module(api.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = False
                self.first, self.second = nets()

            def training_step(self, batch: Any, batch_idx: int) -> None:
                opts = self.optimizers()
                for opt in opts:
                    opt.zero_grad()
                self.manual_backward(loss_of(self.first, self.second, *batch, batch_idx))
                for opt in opts:
                    self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="value")
                for opt in opts:
                    opt.step()

            def on_train_batch_end(self, *args: Any) -> None:
                scales.append(self.trainer.precision_plugin.scaler.get_scale())

            def configure_optimizers(self) -> list:
                return optimizers(self.first, self.second)

        scaler = ShardedGradScaler(device=device, init_scale=W.INIT_SCALE, growth_interval=1)
        kwargs = trainer_kwargs(api, "32", device)
        kwargs.pop("precision")
        if device == "cuda":
            kwargs["strategy"] = "fsdp"
        module = Module()
        trainer = api.Trainer(plugins=[fsdp_precision("16-mixed", scaler=scaler)], **kwargs)
        with quiet():
            trainer.fit(module, train_dataloaders=Loader(data))
        wrapped = trainer.strategy.model
        summon = contextlib.nullcontext()
        if device == "cuda":
            from torch.distributed.fsdp import FullyShardedDataParallel

            if isinstance(wrapped, FullyShardedDataParallel):
                summon = FullyShardedDataParallel.summon_full_params(wrapped)
        def read() -> list[torch.Tensor]:
            return [p.detach().float().cpu().clone() for p in (*module.first.parameters(), *module.second.parameters())]

        try:
            with summon:
                return read(), scales
        except RuntimeError:  # after teardown; on one rank, with use_orig_params, the parameters are whole anyway
            return read(), scales

    with part.row("FSDPPrecision('16-mixed', scaler=ShardedGradScaler(...)), two optimizers, one backward, "
                  "manual value clipping" + (", strategy='fsdp' on one GPU" if device == "cuda" else
                                             " (CPU: one-device Trainer, gloo group)")) as row:
        if device != "cuda" and not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
            dist.init_process_group("gloo", rank=0, world_size=1)
        reference, recipe_error = attempt(recipe)
        expected, expected_scales = reference if reference is not None else (None, None)
        runs = fork_and_stock(run)
        if dist.is_initialized():  # ours (CPU) or the FSDP strategy's (CUDA): a group left at exit can hang it
            dist.destroy_process_group()
        row["recipe"] = f"raises {recipe_error}" if recipe_error else "reference (autocast, GradScaler)"
        for who, (res, err) in runs.items():
            if err is not None:
                row[who], row["data"][who] = f"raises {err}", {"error": err}
                continue
            params, scales = res
            if expected is None:
                row[who], row["data"][who] = "ran (the recipe failed)", {"scales": scales}
                continue
            bitwise = all(torch.equal(a, b) for a, b in zip(params, expected))
            diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(params, expected))
            finite = all(torch.isfinite(p).all().item() for p in params)
            row[who] = ("bitwise" if bitwise else f"max abs diff {diff:.3g}") + (
                "" if scales == expected_scales else f", scales {scales} vs {expected_scales}")
            row["data"][who] = {"bitwise": bitwise, "max_abs_diff": diff, "scales": scales, "finite": finite,
                                "same_scales": scales == expected_scales}
        fork = row["data"].get("fork", {})
        exact_expected = device != "cuda"  # FSDP's fp16 parameters round differently from autocast on CUDA
        ok = fork.get("same_scales") and fork.get("finite") and (fork.get("bitwise") or not exact_expected)
        row["verdict"] = "PASS" if ok else "FAIL"
        if device == "cuda":
            row["notes"] = "PASS needs the recipe's scale trajectory and finite weights; FSDP's fp16 parameters make " \
                           "the weights differ from autocast's by design"


def part_equivalence(part: Part) -> None:
    device, p16 = part.device, "16-mixed"
    net = W.mlp()

    def case(check: str, step: Callable, configure: Callable, loop: Callable, automatic: bool,
             **extra: Any) -> None:
        with part.row(check) as row:
            expected, recipe_error = attempt(lambda: run_recipe(loop, net, configure, p16, device, automatic))
            runs = fork_and_stock(lambda p: fit(p, p16, device, net, configure, step, automatic, **extra))
            fill_comparison(row, expected, runs, recipe_error)

    adamw = functools.partial(H.one_optimizer, name="AdamW")
    case("manual optimization, 16-mixed: self.clip_gradients(opt, norm) clips unscaled gradients (#18089)",
         H.manual_clip("norm"), adamw, H.recipe_clip("norm"), automatic=False)
    case("manual optimization, 16-mixed: two optimizers fed by one backward, one scaler update per iteration",
         H.manual_two_optimizers, lambda n: H.two_optimizers(n, "AdamW"), H.recipe_two_optimizers, automatic=False)
    fused_optimizers = {
        "AdamW(fused=True)": lambda n: [torch.optim.AdamW(H.trainable(n), lr=1e-2, fused=True)],
        "SGD(momentum=0.9, fused=True)": lambda n: [torch.optim.SGD(H.trainable(n), lr=0.1, momentum=0.9, fused=True)],
    }
    for name, configure in fused_optimizers.items():
        case(f"automatic optimization, 16-mixed: {name} with gradient_clip_val (#15501)", H.auto_plain, configure,
             H.recipe_clip("norm"), automatic=True, gradient_clip_val=W.CLIP_NORM)

    def skip_step(self: Any, batch: Any, batch_idx: int) -> None:
        H.manual_plain(self, batch, batch_idx)
        self.records.append(getattr(self.optimizers(), "step_was_skipped", "absent"))

    skip_optimizers = {
        "AdamW": adamw,
        "AdamW(fused=True)": fused_optimizers["AdamW(fused=True)"],
    }
    for name, configure in skip_optimizers.items():
        with part.row(f"skip signal: opt.step_was_skipped after each manual {name} step, inf at batch "
                      f"{W.INF_BATCH}") as row:
            expected, recipe_error = attempt(lambda: run_recipe(H.recipe_plain, net, configure, p16, device, False))
            row["recipe"] = f"raises {recipe_error}" if recipe_error else "skipped where its weights did not change"
            want = None if expected is None else [not c for c in expected.changed]
            for who, (res, err) in fork_and_stock(lambda p: fit(p, p16, device, net, configure, skip_step,
                                                                False)).items():
                if err is not None:
                    row[who], row["data"][who] = f"raises {err}", {"error": err}
                    continue
                signal = res.records
                row["data"][who] = {"signal": signal, "expected": want}
                if all(s == "absent" for s in signal):
                    row[who] = "no step_was_skipped attribute"
                else:
                    row[who] = ("matches the recipe" if signal == want else f"{signal} vs recipe {want}") + (
                        f" (skipped: batches {[i for i, s in enumerate(signal) if s is True]})")
            row["verdict"] = "PASS" if want is not None and row["data"].get("fork", {}).get("signal") == want else "FAIL"
    resume_rows(part)
    fsdp_rows(part)


# ---------------------------------------------------------------------------------------------------- 3. cost
class SmallTransformer(nn.Module):
    """``layers`` pre-norm encoder layers (``d`` wide, 4 heads) over ``[batch, seq, d]``, regressing the last token."""

    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, d)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.encoder(x)[:, -1]).float(), y)


#: the cost part's sizes: (CUDA, dry run on the CPU)
COST_SIZES = {
    False: {"mlp_width": 256, "mlp_depth": 4, "mlp_batch": 256, "many_width": 8, "many_layers": 500,
            "many_batch": 64, "tf_d": 256, "tf_layers": 2, "tf_seq": 64, "tf_batch": 32},
    True: {"mlp_width": 16, "mlp_depth": 4, "mlp_batch": 4, "many_width": 4, "many_layers": 10,
           "many_batch": 4, "tf_d": 16, "tf_layers": 1, "tf_seq": 4, "tf_batch": 2},
}


@dataclass(frozen=True)
class CostCell:
    model: str  # "mlp", "many", "transformer"
    precision: str
    fused: bool
    automatic: bool = True

    def name(self, sizes: dict) -> str:
        """The row's label, with the model's sizes (the dry run's are tiny)."""
        model = {
            "mlp": f"{sizes['mlp_depth']} x {sizes['mlp_width']} MLP",
            "many": f"{2 * sizes['many_layers']}-parameter-tensor model",
            "transformer": f"{sizes['tf_layers']}-layer transformer (d={sizes['tf_d']}, seq {sizes['tf_seq']})",
        }[self.model]
        return (f"{model}, {self.precision} {'fused' if self.fused else 'foreach'} AdamW + StepLR, "
                f"{'automatic' if self.automatic else 'manual'}")


def cost_cells(dry_run: bool) -> list[CostCell]:
    if dry_run:
        return [CostCell("mlp", "16-mixed", True), CostCell("transformer", "bf16-mixed", False),
                CostCell("many", "16-mixed", False, automatic=False)]
    cells = [CostCell(m, p, f) for m in ("mlp", "many", "transformer") for p in ("bf16-mixed", "16-mixed")
             for f in (True, False)]
    # manual optimization under 16-mixed: where the fork's misuse watch (if on) adds per-parameter hooks
    return cells + [CostCell(m, "16-mixed", False, automatic=False) for m in ("mlp", "many")]


def cost_model(cell: CostCell, sizes: dict) -> nn.Module:
    torch.manual_seed(0)
    if cell.model == "transformer":
        return SmallTransformer(sizes["tf_d"], sizes["tf_layers"])
    return build_model(cell.model, sizes)


def cost_batches(cell: CostCell, sizes: dict, device: str, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    if cell.model == "transformer":
        shapes = ((sizes["tf_batch"], sizes["tf_seq"], sizes["tf_d"]), (sizes["tf_batch"], sizes["tf_d"]))
    else:
        width, batch = sizes[f"{cell.model}_width"], sizes[f"{cell.model}_batch"]
        shapes = ((batch, width), (batch, width))
    return [tuple(torch.randn(s, generator=g).to(device) for s in shapes) for _ in range(count)]  # type: ignore[misc]


def cost_optimizer(params: Any, fused: bool) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True) if fused else torch.optim.AdamW(params, lr=1e-4,
                                                                                          foreach=True)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)


class SyncCounter:
    """Counts host synchronisations between :meth:`start` and :meth:`stop` with ``torch.cuda.set_sync_debug_mode
    ("warn")``: torch warns at every synchronising CUDA call (``.item()``, a device-to-host copy, ``nonzero``...).
    ``torch.cuda.synchronize()`` itself is not counted, and a CPU run counts none."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._caught: Optional[list] = None
        self._cm: Optional[Any] = None
        self.count = 0

    def start(self) -> None:
        self._cm = warnings.catch_warnings(record=True)
        self._caught = self._cm.__enter__()
        warnings.simplefilter("always")
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self._cm is None:
            return
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        caught = self._caught or []
        self.count = sum("synchroniz" in str(w.message) for w in caught)
        self._cm.__exit__(None, None, None)
        self._cm = None


class StepMarks:
    """Marks at the start of each iteration: times (device-synchronised first) or, with ``syncs``, counting host
    synchronisations over iterations ``warmup`` to ``warmup + steps``."""

    def __init__(self, device: str, warmup: int, steps: int, syncs: bool) -> None:
        self.device, self.warmup, self.steps, self.syncs = device, warmup, steps, syncs
        self.times: list[float] = []
        self.counter = SyncCounter(device)
        self.k = 0

    def mark(self) -> None:
        if self.syncs:
            if self.k == self.warmup:
                self.counter.start()
            elif self.k == self.warmup + self.steps:
                self.counter.stop()
        else:
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
        self.k += 1

    def result(self) -> float:
        """Median seconds per step after warm-up, or host synchronisations per step."""
        if self.syncs:
            self.counter.stop()
            return self.counter.count / self.steps
        steps = [b - a for a, b in zip(self.times, self.times[1:])][self.warmup:]
        return statistics.median(steps)


@functools.cache
def cost_module_class(package: str) -> tuple[type, type]:
    """The cost runs' LightningModule (the cell's model, AdamW and a step-interval StepLR, automatic or manual) and
    the callback that marks each iteration's start, for ``package``."""
    api = H.lightning_api(package)

    class CostModule(api.LightningModule):
        def __init__(self, model: nn.Module, cell: CostCell) -> None:
            super().__init__()
            self.model, self.cell = model, cell
            self.automatic_optimization = cell.automatic

        def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
            if self.automatic_optimization:
                return self.model.loss(*batch)
            opt, scheduler = self.optimizers(), self.lr_schedulers()
            opt.zero_grad()
            self.manual_backward(self.model.loss(*batch))
            opt.step()
            scheduler.step()
            return None

        def configure_optimizers(self) -> dict:
            opt, scheduler = cost_optimizer(self.parameters(), self.cell.fused)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Marks(api.Callback):
        def __init__(self, marks: StepMarks) -> None:
            self.marks = marks

        def on_train_batch_start(self, *args: Any) -> None:
            self.marks.mark()

    return CostModule, Marks


def cost_scaler(device: str) -> Any:
    # one moderate initial scale for every contender (as `make bench`): no measured step skips from a huge first scale
    return make_scaler(device, init_scale=2.0**10)


def cost_run(who: str, cell: CostCell, sizes: dict, device: str, warmup: int, steps: int, syncs: bool) -> float:
    """One run of ``cell`` by ``who`` (``fork``, ``stock`` or ``recipe``): seconds per step, or host syncs per step."""
    model = cost_model(cell, sizes).to(device)
    batches = cost_batches(cell, sizes, device)
    total = warmup + steps + 1
    marks = StepMarks(device, warmup, steps, syncs)
    if who == "recipe":
        opt, scheduler = cost_optimizer(model.parameters(), cell.fused)
        dtype = torch.float16 if cell.precision == "16-mixed" else torch.bfloat16
        scaler = cost_scaler(device) if cell.precision == "16-mixed" else None
        for i in range(total):
            marks.mark()
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype):
                loss = model.loss(x, y)
            recipe_after_forward(loss, [opt], scaler)
            scheduler.step()
        marks.mark()
        return marks.result()
    package = H.FORK if who == "fork" else H.STOCK
    api = H.lightning_api(package)
    module_cls, marks_cls = cost_module_class(package)
    kwargs = trainer_kwargs(api, cell.precision, device, scaler=cost_scaler(device))
    kwargs.update(max_steps=total, callbacks=[marks_cls(marks)])
    loader = torch.utils.data.DataLoader([batches[i % len(batches)] for i in range(total + 1)], batch_size=None)
    with quiet():
        api.Trainer(**kwargs).fit(module_cls(model, cell), train_dataloaders=loader)
    return marks.result()


def part_cost(part: Part) -> None:
    device, dry = part.device, part.dry_run
    sizes = COST_SIZES[dry]
    warmup, steps = (1, 3) if dry else (5, 20)
    cells = cost_cells(dry)
    # host synchronisations per step: one short run per contender and cell
    for cell in cells:
        with part.row(f"host syncs per step: {cell.name(sizes)}") as row:
            for who in ("fork", "stock", "recipe"):
                value, err = attempt(lambda: cost_run(who, cell, sizes, device, 3 if not dry else 1,
                                                      5 if not dry else 2, syncs=True))
                row[who] = f"raises {err}" if err else f"{value:.2f}"
                row["data"][who] = {"error": err} if err else {"syncs_per_step": value}
            counts = {who: row["data"][who].get("syncs_per_step") for who in ("fork", "stock", "recipe")}
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
            order = ("fork", "stock", "recipe") if r % 2 == 0 else ("stock", "fork", "recipe")
            for who in order:
                if (cell, who) in errors:
                    continue
                value, err = attempt(lambda: cost_run(who, cell, sizes, device, warmup, steps, syncs=False))
                if err:
                    errors[(cell, who)] = err
                else:
                    times.setdefault((cell, who), []).append(value)
        round_s, r = time.time() - started, r + 1
        part.emit("progress", rounds=r, round_s=round_s)
    for cell in cells:
        with part.row(f"time per step: {cell.name(sizes)}") as row:
            for who in ("fork", "stock", "recipe"):
                t = times.get((cell, who), [])
                row[who] = f"raises {errors[(cell, who)]}" if (cell, who) in errors else (
                    f"{statistics.median(t) * 1e3:.3f} ms" if t else "-")
                row["data"][who] = {"step_s": t, "error": errors.get((cell, who))}
            fork, stock = times.get((cell, "fork"), []), times.get((cell, "stock"), [])
            ratios = [f / s for f, s in zip(fork, stock)]  # paired: the same round
            if ratios:
                row["fork"] += f"; fork/stock {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
                row["data"]["fork_over_stock"] = ratios
            row["notes"] = f"median of {len(ratios)} paired rounds, {steps} steps after {warmup} warm-up, " \
                           f"{'CUDA-synchronised' if device == 'cuda' else 'CPU'}"


# ---------------------------------------------------------------------------------------------------- 4. the watch
def watch_switches(package: str) -> list[tuple[str, dict, dict]]:
    """The ways to run with the misuse watch, in the order tried: ``(label, plugin kwargs, trainer kwargs)``."""
    api = H.lightning_api(package)
    switches: list[tuple[str, dict, dict]] = [("on by default", {}, {})]
    for name in inspect.signature(api.MixedPrecision.__init__).parameters:
        if re.search(r"watch|misuse|detect|anomal|check|debug|strict|guard", name):
            switches.append((f"MixedPrecision({name}=True)", {name: True}, {}))
    if "detect_anomaly" in inspect.signature(api.Trainer.__init__).parameters:
        switches.append(("Trainer(detect_anomaly=True)", {}, {"detect_anomaly": True}))
    return switches


def watch_fit(package: str, device: str, step: Callable, plugin_kwargs: dict, trainer_extra: dict,
              configure: Callable = lambda n: [H.make_optimizer("AdamW", H.trainable(n))]) -> H.RunResult:
    api = H.lightning_api(package)
    plugin = api.MixedPrecision("16-mixed", device, scaler=recipe_scaler(device), **plugin_kwargs)
    module = api.RecipeModule(W.mlp(), configure, step, False, "16-mixed")
    kwargs = trainer_kwargs(api, "32", device)
    kwargs.pop("precision")
    trainer = api.Trainer(plugins=[plugin], **kwargs, **trainer_extra)
    with quiet():
        trainer.fit(module, train_dataloaders=H.Batches())
    return H.RunResult({n: p.detach().cpu() for n, p in module.net.named_parameters()}, None, [])


def misuse_plain_backward(self: Any, batch: Any, batch_idx: int) -> None:
    """A scaled backward and ``loss.backward()`` into the same gradients: the second one is not scaled."""
    opt = self.optimizers()
    x, y = batch
    opt.zero_grad()
    self.manual_backward(W.mlp_loss(self.net, x, y))
    W.mlp_loss(self.net, x, y).backward()
    opt.step()


def misuse_raw_step(self: Any, batch: Any, batch_idx: int) -> None:
    """A step of the raw ``torch.optim`` optimizer on gradients still multiplied by the scale."""
    opt = self.optimizers()
    x, y = batch
    opt.zero_grad()
    self.manual_backward(W.mlp_loss(self.net, x, y))
    opt.optimizer.step()


def correct_checkpointed(self: Any, batch: Any, batch_idx: int) -> None:
    """Correct code whose backward runs a nested backward: a reentrant activation checkpoint (on CUDA the engine's
    device thread runs the hooks)."""
    from torch.utils.checkpoint import checkpoint

    opt = self.optimizers()
    x, y = batch
    opt.zero_grad()
    # the reentrant form needs an input that requires grad to record its backward at all
    out = checkpoint(self.net, x.detach().requires_grad_(), use_reentrant=True)
    self.manual_backward(F.mse_loss(out, y))
    opt.step()


def correct_two_backwards(self: Any, batch: Any, batch_idx: int) -> None:
    """Correct code: two scaled backwards into one set of gradients, two optimizers, several iterations."""
    opt_a, opt_b = self.optimizers()
    x, y = batch
    opt_a.zero_grad()
    opt_b.zero_grad()
    for xk, yk in H.chunks(x, y, 2):
        self.manual_backward(W.mlp_loss(self.net, xk, yk))
    opt_a.step()
    opt_b.step()


def part_watch(part: Part) -> None:
    device = part.device
    switch: Optional[tuple[str, dict, dict]] = None
    tried: list[str] = []
    with part.row("misuse: loss.backward() mixed into scaled gradients (manual, 16-mixed)") as row:
        for label, plugin_kwargs, trainer_extra in watch_switches(H.FORK):
            _, err = attempt(lambda: watch_fit(H.FORK, device, misuse_plain_backward, plugin_kwargs, trainer_extra))
            tried.append(f"{label}: {'caught' if err else 'not caught'}")
            if err:
                switch, row["fork"] = (label, plugin_kwargs, trainer_extra), f"caught ({label}): {err}"
                break
        _, stock_err = attempt(lambda: watch_fit(H.STOCK, device, misuse_plain_backward, {}, {}))
        row["stock"] = f"caught: {stock_err}" if stock_err else "not caught (trains on)"
        row["recipe"] = "-"
        row["data"] = {"tried": tried, "switch": switch[0] if switch else None}
        if switch is None:
            row["fork"], row["verdict"] = "not available: " + "; ".join(tried), "N/A"
        else:
            row["verdict"] = "PASS"
        row["notes"] = "switch: " + (switch[0] if switch else "none found")
    label, plugin_kwargs, trainer_extra = switch or ("default", {}, {})
    with part.row("misuse: step of the raw optimizer on scaled gradients") as row:
        _, err = attempt(lambda: watch_fit(H.FORK, device, misuse_raw_step, plugin_kwargs, trainer_extra))
        row["fork"] = f"caught: {err}" if err else "not caught"
        _, stock_err = attempt(lambda: watch_fit(H.STOCK, device, misuse_raw_step, {}, {}))
        row["stock"] = f"caught: {stock_err}" if stock_err else "not caught (trains on)"
        row["recipe"] = "-"
        row["verdict"] = "N/A" if switch is None and not err else ("PASS" if err else "FAIL")
        row["notes"] = f"switch: {label}"
    correct = {
        "correct code: reentrant activation checkpoint (nested backward on the engine's thread)":
            (correct_checkpointed, lambda n: [H.make_optimizer("AdamW", H.trainable(n))]),
        "correct code: two scaled backwards per step, two optimizers, 8 iterations":
            (correct_two_backwards, lambda n: H.two_optimizers(n, "AdamW")),
    }
    for check, (step, configure) in correct.items():
        with part.row(check) as row:
            res, err = attempt(lambda: watch_fit(H.FORK, device, step, plugin_kwargs, trainer_extra, configure))
            finite = res is not None and all(torch.isfinite(p).all().item() for p in res.params.values())
            row["fork"] = f"false error: {err}" if err else ("no error" + ("" if finite else ", non-finite weights"))
            _, stock_err = attempt(lambda: watch_fit(H.STOCK, device, step, {}, {}, configure))
            row["stock"] = f"raises {stock_err}" if stock_err else "no error"
            row["recipe"] = "-"
            row["verdict"] = "PASS" if not err and finite else "FAIL"
            row["notes"] = f"switch: {label}" + ("" if switch else " (none found: the default path)")


# ---------------------------------------------------------------------------------------------------- main
def versions() -> dict[str, str]:
    """torch, CUDA, the GPU, the fork, stock and Python versions, as far as this interpreter has them."""
    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    for key, module in (("fork", "lightning"), ("stock", H.STOCK)):
        try:
            out[key] = __import__(module).__version__
        except ImportError:
            out[key] = "absent"
    return out


PART_FUNCTIONS: dict[str, Callable[[Part], None]] = {
    "reports": part_reports, "equivalence": part_equivalence, "cost": part_cost, "watch": part_watch,
}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=PARTS + ("versions",))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes and one round (a pipeline check)")
    p.add_argument("--out", type=Path, required=True, help="JSON-lines file the records are appended to")
    p.add_argument("--deadline", type=float, default=None, help="unix time by which the part should end")
    args = p.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric", H.STOCK, "stock_lightning_fabric"):
        with contextlib.suppress(ImportError):
            __import__(name)  # its import sets its logger's level: silence it afterwards
        logging.getLogger(name).setLevel(logging.ERROR)  # "GPU available: ..." and tips, at every fit
    part = Part(args.out, args.device, args.dry_run, args.deadline or time.time() + 3600)
    if args.part == "versions":
        part.emit("meta", versions=versions(), cuda_available=torch.cuda.is_available())
        part.emit("done")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        part.emit("meta", versions=versions(), cuda_available=False)
        print(f"torch {torch.__version__} here sees no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the recipe and Lightning must run the same kernels
    PART_FUNCTIONS[args.part](part)
    part.emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
