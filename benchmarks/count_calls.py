"""Python work per training step, counted, not timed: the fork against stock Lightning 2.6.6 and PyTorch's recipe.

    .venv/bin/python benchmarks/count_calls.py                 # every workload and mode -> a table on stdout
    .venv/bin/python benchmarks/count_calls.py --workloads mlp --modes manual --top 10 --json out.json

Each measurement runs in its own interpreter and trains a workload of ``benchmarks/workloads.py`` for 46 steps under
16-mixed (a CPU ``GradScaler``) or bf16-mixed, with a step-interval LR scheduler (stepped by Lightning in automatic
optimization, by hand elsewhere); over steps 16-45 (30 steady-state steps) it counts:

- **Python calls**: every ``call`` event of ``sys.setprofile`` (functions, methods, generators resumed, lambdas;
  calls into C are not counted), per step; and which functions they were, so a difference names what adds it.
- **Host reads**: calls of ``Tensor.item``, ``Tensor.__bool__``, ``Tensor.__float__``, ``Tensor.__int__`` and
  ``Tensor.tolist`` (each a device synchronisation on CUDA), per step.

The fork is ``lightning`` as installed; stock is the unpatched copy that ``make setup`` puts beside it as
``stock_pytorch_lightning`` / ``stock_lightning_fabric``, both reached and given their Trainer through the tests'
oracle (``tests/amp_oracle``, put on ``PYTHONPATH`` for each measurement); "recipe" is ``workloads.recipe_step``,
the hand-written loop ``worker.run_raw`` times. Counts are deterministic for a given torch and Python, so one run
each suffices (no rounds, no noise band).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
STEPS, FIRST, LAST = 46, 16, 46  # count over steps FIRST .. LAST - 1
#: small shapes: the counts do not depend on the sizes, only the run time does
SIZES = {"mlp_width": 256, "mlp_depth": 4, "mlp_batch": 8, "many_width": 8, "many_layers": 500, "many_batch": 4}
HOST_READS = ("item", "__bool__", "__float__", "__int__", "tolist")


class Counter:
    """Counts Python calls (by function) and host reads while switched on."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.reads: collections.Counter = collections.Counter()
        self.on = False

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            self.calls[f"{Path(code.co_filename).name}:{code.co_name}"] += 1

    def start(self) -> None:
        self.on = True
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        self.on = False

    def wrap_host_reads(self) -> None:
        import torch

        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                if self.on:
                    self.reads[_name] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)


def measure(impl: str, workload: str, mode: str, precision: str, fused: bool, clip: float) -> dict:
    """One measurement in this interpreter: ``impl`` is fork, stock or recipe."""
    import torch
    from amp_oracle.trainer import FORK, STOCK, lightning_api, make_trainer
    from amp_oracle.world import autocast_dtype, new_scaler
    from workloads import (build_batches, build_model, build_optimizer, build_scheduler, fabric_step, lightning_module,
                           make_fabric, recipe_step)

    counter = Counter()
    counter.wrap_host_reads()
    torch.manual_seed(0)
    batches = build_batches(workload, SIZES, "cpu")
    dtype = autocast_dtype(precision)
    # one moderate scale that never overflows in these runs (as ``make bench``'s): no step is skipped
    scaler = new_scaler("cpu", growth_interval=2000) if precision == "16-mixed" else None

    def window(step: int) -> None:
        if step == FIRST:
            counter.start()
        elif step == LAST:
            counter.stop()

    if impl == "recipe" or mode == "fabric":
        fabric = None
        if mode == "fabric":
            fabric = make_fabric(__import__("lightning.fabric" if impl == "fork" else "stock_lightning_fabric",
                                            fromlist=["Fabric"]), precision, "cpu", scaler)
        model = build_model(workload, SIZES)
        opt = build_optimizer(model.parameters(), fused)
        if fabric is not None:
            model, opt = fabric.setup(model, opt)
        scheduler = build_scheduler(opt if fabric is None else opt.optimizer)
        for step in range(STEPS + 1):
            window(step)
            x, y = batches[step % len(batches)]
            if fabric is None:
                recipe_step(model, opt, scaler, x, y, "cpu", dtype, clip)
            else:
                fabric_step(fabric, model, opt, x, y, clip)
            scheduler.step()
    else:
        from torch.utils.data import DataLoader

        api = lightning_api(FORK if impl == "fork" else STOCK)

        class Window(api.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                window(batch_idx)

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                counter.stop()

        module = lightning_module(api.pl, build_model(workload, SIZES), mode, fused, clip=clip, scheduler=True)
        trainer = make_trainer(api, precision, scaler=scaler, max_steps=STEPS + 1, callbacks=[Window()],
                               gradient_clip_val=clip if (clip and mode == "auto") else None)
        data = [batches[i % len(batches)] for i in range(STEPS + 1)]
        trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None))
    counter.stop()
    steps = LAST - FIRST
    return {
        "calls_per_step": sum(counter.calls.values()) / steps,
        "reads_per_step": sum(counter.reads.values()) / steps,
        "reads": dict(counter.reads),
        "calls": dict(counter.calls),
    }


def run_one(impl: str, workload: str, mode: str, precision: str, fused: bool, clip: float) -> dict:
    spec = json.dumps([impl, workload, mode, precision, fused, clip])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def top_differences(fork: dict, stock: dict, top: int) -> list[str]:
    """The functions whose calls per step differ most between the fork and stock (fork minus stock)."""
    steps = LAST - FIRST
    names = set(fork["calls"]) | set(stock["calls"])
    diff = {n: (fork["calls"].get(n, 0) - stock["calls"].get(n, 0)) / steps for n in names}
    ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
    return [f"{name} {delta:+.1f}" for name, delta in ranked if delta]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "many"], choices=["mlp", "many"])
    parser.add_argument("--modes", nargs="+", default=["manual", "auto", "fabric"], choices=["manual", "auto", "fabric"])
    parser.add_argument("--precisions", nargs="+", default=["16-mixed"], choices=["16-mixed", "bf16-mixed"])
    parser.add_argument("--fused", nargs="+", type=int, default=[0, 1], help="0: for-loop AdamW, 1: fused AdamW")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="clip by norm at this value (0: no clipping); fused rows never clip: stock refuses to")
    parser.add_argument("--top", type=int, default=5, help="name the functions that add the most calls")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*json.loads(args.one))))
        return 0
    rows, results = [], []
    print("| workload | mode | precision | AdamW, clip | calls/step fork | stock | fork/stock | host reads/step fork |"
          " stock | recipe | most added by the fork |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for workload in args.workloads:
        for precision in args.precisions:
            for fused in args.fused:
                clip = 0.0 if fused else args.clip
                recipe = run_one("recipe", workload, "recipe", precision, bool(fused), clip)
                for mode in args.modes:
                    fork = run_one("fork", workload, mode, precision, bool(fused), clip)
                    stock = run_one("stock", workload, mode, precision, bool(fused), clip)
                    ratio = fork["calls_per_step"] / stock["calls_per_step"]
                    row = (f"| {workload} | {mode} | {precision} | {'fused' if fused else 'for-loop'}, {clip:g} |"
                           f" {fork['calls_per_step']:.1f} | {stock['calls_per_step']:.1f} | {ratio:.3f} |"
                           f" {fork['reads_per_step']:.2f} | {stock['reads_per_step']:.2f} |"
                           f" {recipe['reads_per_step']:.2f} | {'; '.join(top_differences(fork, stock, args.top))} |")
                    print(row, flush=True)
                    rows.append(row)
                    results.append({"workload": workload, "mode": mode, "precision": precision, "fused": bool(fused),
                                    "clip": clip, "fork": fork, "stock": stock, "recipe": recipe})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
