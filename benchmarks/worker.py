"""One measurement, in its own process: a workload trained by Lightning (whichever ``lightning`` this interpreter has,
the fork or stock 2.6.6) or by the hand-written PyTorch loop, for ``warmup + steps`` timed steps.

``benchmarks/run.py`` starts it as ``<venv>/bin/python benchmarks/worker.py '<json spec>'`` (one interpreter per
measurement), or once per virtual environment as ``worker.py --serve``, a fork server that runs every measurement in a
forked child (see :func:`serve`). Each measurement talks to the runner over a Unix socket (:class:`Channel`): in
lock-step it waits for its turn at the start of every iteration (:class:`StepClock`), and it ends with its step times
(seconds) and peak memory growth (bytes).

What a step time is
    The time from the start of one training iteration to the start of the next: in Lightning the interval between two
    consecutive ``on_train_batch_start`` hooks (a Callback), in the PyTorch loop between two consecutive loop heads
    (in lock-step, less the time spent waiting for its turn at the first of them). It covers everything the Trainer
    does per batch: forward, backward, clipping, the optimizer step, the precision plugin's per-iteration bookkeeping
    (the fork's scaler update runs after the last step, before ``on_train_batch_end``), the batch-end hooks and the
    fetch of the next batch. It excludes the Trainer's start-up and tear-down, paid once per ``fit``, which would
    dominate a short run. The first
    ``warmup`` iterations are dropped (allocator warm-up, lazy optimizer state, the scaler's first steps); the runner
    takes the median of the rest. On CPU the process's CPU time (``time.process_time``) is read at the same marks: a
    second figure, which other processes on a shared machine do not inflate. On CUDA, free-running marks are CUDA
    events read with ``Event.elapsed_time`` after a final ``torch.cuda.synchronize()``; in lock-step each mark
    synchronizes and reads the host clock (see :class:`StepClock`).

What the memory figure is
    The peak memory growth during training, measured from the moment training starts (model and optimizer built and
    on the device; Lightning's ``on_train_start``) to its end. On CUDA: ``torch.cuda.max_memory_allocated()`` minus
    ``torch.cuda.memory_allocated()`` at the start, after ``torch.cuda.reset_peak_memory_stats()``. On CPU, torch's
    allocations are invisible to ``tracemalloc``, so it is the process's resident set: Linux's peak-RSS mark is reset
    at the start (``/proc/self/clear_refs`` = 5), and the figure is ``VmHWM`` at the end minus ``VmRSS`` at the start.
    Where that reset is not allowed, ``ru_maxrss`` at the end minus RSS at the start is used instead (only sound when
    training is the process's peak, which it is here). One process per measurement keeps earlier runs out of the figure.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings

import torch

from workloads import (build_batches, build_model, build_optimizer, fabric_step, lightning_module, make_fabric,
                       recipe_step)


# ---------------------------------------------------------------------------------------------------- measuring
def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryMeter:
    """Peak memory growth from :meth:`start` to :meth:`stop` (see the module's docstring)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.method = ""
        self._base = 0
        self._hwm_reset = False

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            self.method = "torch.cuda.max_memory_allocated"
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm_reset = True
            self.method = "VmHWM (reset at start)"
        except OSError:
            self._hwm_reset = False
            self.method = "ru_maxrss"
        rss = _proc_status_kib("VmRSS")
        self._base = (rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def stop(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self._base
        peak = _proc_status_kib("VmHWM") if self._hwm_reset else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return peak * 1024 - self._base


class Channel:
    """This measurement's Unix socket to the runner: ``ready`` at each iteration's start, then (lock-step) wait for
    ``go``; its last line ``result {json}``. A measurement that dies closes it, so the runner does not wait for ever."""

    def __init__(self, path: str, run_id: str) -> None:
        import socket

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.file = self.sock.makefile("rwb", buffering=0)
        self.send(f"hello {run_id}")

    def send(self, line: str) -> None:
        self.file.write(line.encode() + b"\n")

    def wait_go(self) -> None:
        if self.file.readline().strip() != b"go":
            raise SystemExit("the runner went away")


class StepClock:
    """Marks the start of every iteration (wall and CPU time). Free-running (``gate=None``) an iteration lasts from one
    mark to the next; in lock-step, at every mark the clock stops, says ``ready`` and waits for its turn, so an
    iteration runs from its ``go`` to the next mark. On CUDA lock-step synchronizes at each mark (one process's kernels
    must not run into the next one's turn); free-running, the marks are CUDA events."""

    def __init__(self, device: str, gate: Channel | None = None) -> None:
        self.device = device
        self.gate = gate
        self.events = device == "cuda" and gate is None
        self.starts: list = []
        self.ends: list = []
        self.cpu_starts: list[float] = []
        self.cpu_ends: list[float] = []

    def _now(self):
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self) -> None:
        if self.gate is None:
            now, cpu = self._now(), time.process_time()
            if self.starts:
                self.ends.append(now)
                self.cpu_ends.append(cpu)
        else:
            if self.starts:
                self.ends.append(self._now())
                self.cpu_ends.append(time.process_time())
            self.gate.send("ready")
            self.gate.wait_go()
            now, cpu = self._now(), time.process_time()
        self.starts.append(now)
        self.cpu_starts.append(cpu)

    def intervals(self) -> list[float]:
        pairs = list(zip(self.starts, self.ends))
        if self.events:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in pairs]
        return [b - a for a, b in pairs]

    def cpu_intervals(self) -> list[float] | None:
        if self.device == "cuda":
            return None  # the host's CPU time says little about asynchronous GPU work
        return [b - a for a, b in zip(self.cpu_starts, self.cpu_ends)]


# ---------------------------------------------------------------------------------------------------- the work
def _loader(batches, total: int):
    """A DataLoader that hands out the pre-built batches (already on the device) ``total`` times, without collation."""
    from torch.utils.data import DataLoader

    return DataLoader([batches[i % len(batches)] for i in range(total)], batch_size=None, shuffle=False)


def _scaler(device: str) -> torch.amp.GradScaler:
    # one moderate initial scale for every contender, so none spends its measured steps skipping overflowed ones
    return torch.amp.GradScaler(device, init_scale=2.0**10)


def _result(clock: StepClock, meter: MemoryMeter, mem: int, lightning: str | None, **extra) -> dict:
    return {"times": clock.intervals(), "cpu_times": clock.cpu_intervals(), "mem": mem, "mem_method": meter.method,
            "lightning": lightning, **extra}


def run_raw(spec: dict, gate: Channel | None = None) -> dict:
    """PyTorch's AMP recipe, written out: autocast around the forward pass and loss only; for 16-mixed
    ``scaler.scale(loss).backward()``, ``scaler.unscale_`` before clipping, ``scaler.step``, ``scaler.update``."""
    device, precision, clip = spec["device"], spec["precision"], spec["clip"]
    torch.manual_seed(0)
    model = build_model(spec["workload"], spec["sizes"]).to(device).train()
    opt = build_optimizer(model.parameters(), spec["fused"], spec.get("foreach"))
    total = spec["warmup"] + spec["steps"] + 1
    loader = _loader(build_batches(spec["workload"], spec["sizes"], device), total)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = _scaler(device) if precision == "16-mixed" else None
    clock, meter = StepClock(device, gate), MemoryMeter(device)

    meter.start()
    for x, y in loader:
        clock.mark()
        recipe_step(model, opt, scaler, x, y, device, dtype, clip)
    return _result(clock, meter, meter.stop(), None)


def run_lightning(spec: dict, gate: Channel | None = None) -> dict:
    """The same work through ``lightning.pytorch.Trainer``, in automatic or manual optimization."""
    import lightning
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    device, precision, clip, mode = spec["device"], spec["precision"], spec["clip"], spec["mode"]
    workload, sizes, fused, foreach = spec["workload"], spec["sizes"], spec["fused"], spec.get("foreach")
    clock, meter = StepClock(device, gate), MemoryMeter(device)

    class Clock(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            meter.start()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            clock.mark()

        def on_train_end(self, trainer, pl_module) -> None:
            self.mem = meter.stop()

    timer = Clock()
    total = spec["warmup"] + spec["steps"] + 1
    kwargs: dict = {"precision": precision}
    if precision == "16-mixed":  # a scaler of the benchmark's settings (on a CPU the flag alone would become bf16)
        kwargs = {"plugins": [MixedPrecision("16-mixed", device, scaler=_scaler(device))]}
    if clip and mode == "auto":
        kwargs["gradient_clip_val"] = clip
    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=total, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
                         **kwargs)
    torch.manual_seed(0)
    module = lightning_module(pl, build_model(workload, sizes), mode, fused, foreach, clip)
    trainer.fit(module, train_dataloaders=_loader(build_batches(workload, sizes, device), total))
    return _result(clock, meter, timer.mem, lightning.__version__,
                   autocast_cache=_autocast_cache(trainer.precision_plugin))


def run_fabric(spec: dict, gate: Channel | None = None) -> dict:
    """The same work through ``lightning.fabric.Fabric``, in the hand-written loop of :func:`workloads.fabric_step`."""
    import lightning
    import lightning.fabric

    device = spec["device"]
    scaler = _scaler(device) if spec["precision"] == "16-mixed" else None
    fabric = make_fabric(lightning.fabric, spec["precision"], device, scaler)
    torch.manual_seed(0)
    model = build_model(spec["workload"], spec["sizes"])
    model, opt = fabric.setup(model, build_optimizer(model.parameters(), spec["fused"], spec.get("foreach")))
    batches = build_batches(spec["workload"], spec["sizes"], device)
    clock, meter = StepClock(device, gate), MemoryMeter(device)
    meter.start()
    for i in range(spec["warmup"] + spec["steps"] + 1):
        x, y = batches[i % len(batches)]
        clock.mark()
        fabric_step(fabric, model, opt, x, y, spec["clip"])
    return _result(clock, meter, meter.stop(), lightning.__version__)


def _autocast_cache(plugin) -> bool | None:
    """Whether the precision plugin's autocast caches casts (None: the plugin does not autocast)."""
    make = getattr(plugin, "autocast_context_manager", None)
    return None if make is None else getattr(make(), "_cache_enabled", None)


def run_spec(spec: dict, gate: Channel | None = None) -> dict:
    """Run one measurement in this process and return its result (the JSON of the ``result`` line)."""
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if spec["impl"] == "raw":
        result = run_raw(spec, gate)
    elif spec["mode"] == "fabric":
        result = run_fabric(spec, gate)
    else:
        result = run_lightning(spec, gate)
    result["times"] = result["times"][spec["warmup"]:]
    if result["cpu_times"] is not None:
        result["cpu_times"] = result["cpu_times"][spec["warmup"]:]
    result["torch"] = torch.__version__
    result["threads"] = torch.get_num_threads()
    return result


def measure(spec: dict) -> int:
    """One measurement, reporting through the runner's socket; the exit code."""
    channel = Channel(spec["socket"], spec["run_id"])
    try:
        result, code = run_spec(spec, channel if spec.get("lockstep") else None), 0
    except BaseException as err:  # report it to the runner instead of dying silently
        result, code = {"error": f"{type(err).__name__}: {err}"}, 1
    channel.send("result " + json.dumps(result))
    return code


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def serve() -> None:
    """Fork server: import torch and Lightning once, then start each spec read from stdin (one JSON per line) in a
    forked child, so every measurement gets a fresh process (its own peak-memory mark, no allocator state from the
    previous one) without paying the interpreter's and Lightning's import time again; the children of one workload run
    side by side, in lock-step with the other environment's. Everything the children print goes to stderr. CPU only:
    a parent that touched CUDA cannot fork children that use it (run.py starts one interpreter per measurement there).
    """
    import signal

    _quiet()
    try:
        import lightning.pytorch  # noqa: F401  (imported once, shared by every child)
    except ImportError:
        pass  # a torch-only environment can still run the PyTorch loop
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children report to the runner; nobody waits for them here
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        if os.fork() == 0:  # the child: one measurement, then leave without running the parent's clean-up
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 1
            try:
                code = measure(spec)
            finally:
                sys.stderr.flush()
                os._exit(code)


def main() -> None:
    _quiet()
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    sys.exit(measure(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
