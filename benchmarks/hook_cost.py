"""What the fork's per-parameter gradient hooks cost, per parameter tensor per backward (a micro-benchmark).

Usage (after ``bash benchmarks/setup.sh``; the fork's environment)::

    benchmarks/.venvs/fork/bin/python benchmarks/hook_cost.py            # -> benchmarks/results/hook_cost.md
    benchmarks/.venvs/fork/bin/python benchmarks/hook_cost.py --help

Under 16-mixed in manual optimization the fork's ``GradScalerRecipe.watch_unscaled_backward`` registers a
``register_post_accumulate_grad_hook`` on every parameter (one Python call per parameter per backward) and a
``register_step_pre_hook`` on the optimizer (one call per step). This script trains the many-small-layers workload of
``make bench`` (``workloads.ManyLayers``) through the fork's own ``GradScalerRecipe`` (16-mixed on CPU, ``AdamW(
foreach=True)``), one iteration at a time, in three variants that take turns iteration by iteration on the same model
and optimizer:

* ``none``: no hooks (what automatic optimization, and stock, do);
* ``noop``: a no-op ``register_post_accumulate_grad_hook`` on every parameter and a no-op step pre-hook: what torch
  charges for calling a Python hook at all;
* ``fork``: the fork's hooks (``watch_unscaled_backward``).

It times the backward (``with recipe.backward(): recipe.scale(loss).backward()``) and the step (``recipe.step``) with
the process's CPU time (and wall time), and reports, per variant, the median over iterations and the difference to
``none`` per parameter tensor. Hooks are added and removed between iterations, outside the timed parts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sizes import DEFAULT_SIZES  # noqa: E402
from workloads import build_batches, build_model, build_optimizer  # noqa: E402

VARIANTS = ("none", "noop", "fork")


def main(argv: list[str] | None = None) -> int:
    sizes = DEFAULT_SIZES["cpu"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=sizes["many_layers"], help="Linear layers (2 tensors each)")
    p.add_argument("--width", type=int, default=sizes["many_width"])
    p.add_argument("--batch", type=int, default=sizes["many_batch"])
    p.add_argument("--iterations", type=int, default=60, help="timed iterations per variant (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per variant first (default 5)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(HERE / "results" / "hook_cost.md"))
    args = p.parse_args(argv)

    import lightning
    from lightning.fabric.plugins.precision.amp_recipe import GradScalerRecipe

    torch.set_num_threads(args.threads)
    run_sizes = {"many_layers": args.layers, "many_width": args.width, "many_batch": args.batch}
    torch.manual_seed(0)
    model = build_model("many", run_sizes).train()
    params = [p for p in model.parameters()]
    opt = build_optimizer(params, fused=False, foreach=True)
    batches = build_batches("many", run_sizes, "cpu")
    recipe = GradScalerRecipe(torch.amp.GradScaler("cpu", init_scale=2.0**10))

    noop_handles: list = []

    def add(variant: str) -> None:
        if variant == "fork":
            recipe.watch_unscaled_backward([opt])
        elif variant == "noop":
            noop_handles.append(opt.register_step_pre_hook(lambda *_: None))
            noop_handles.extend(p.register_post_accumulate_grad_hook(lambda _p: None) for p in params)

    def remove(variant: str) -> None:
        if variant == "fork":
            recipe.unwatch()
        for handle in noop_handles:
            handle.remove()
        noop_handles.clear()

    times: dict = {v: {"bwd_cpu": [], "bwd_wall": [], "step_cpu": [], "step_wall": []} for v in VARIANTS}
    load_start = os.getloadavg()[0]
    started = time.time()
    for i in range(args.warmup + args.iterations):
        order = VARIANTS[i % 3:] + VARIANTS[:i % 3]  # rotate who goes first
        for variant in order:
            x, y = batches[i % len(batches)]
            add(variant)
            recipe.iteration_start()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model.loss(x, y)
            c0, w0 = time.process_time(), time.perf_counter()
            with recipe.backward():
                recipe.scale(loss).backward()
            c1, w1 = time.process_time(), time.perf_counter()
            recipe.step(opt)
            c2, w2 = time.process_time(), time.perf_counter()
            recipe.iteration_end()
            remove(variant)
            if i >= args.warmup:
                t = times[variant]
                t["bwd_cpu"].append(c1 - c0)
                t["bwd_wall"].append(w1 - w0)
                t["step_cpu"].append(c2 - c1)
                t["step_wall"].append(w2 - w1)
    elapsed = time.time() - started
    load_end = os.getloadavg()[0]

    n = len(params)
    med = {v: {k: statistics.median(vals) for k, vals in t.items()} for v, t in times.items()}
    # the lower decile: the iterations that other processes disturbed least (steadier than the median on a busy machine)
    low = {v: {k: sorted(vals)[len(vals) // 10] for k, vals in t.items()} for v, t in times.items()}
    lines = [
        "# The fork's per-parameter gradient hooks: cost per parameter tensor (micro-benchmark)",
        "",
        "Produced by `benchmarks/.venvs/fork/bin/python benchmarks/hook_cost.py` (see its docstring) on "
        f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, {elapsed:.0f} s: "
        f"{args.layers} x (Linear({args.width}) + tanh), {n} parameter tensors, batch {args.batch}, 16-mixed on CPU "
        f"through the fork's `GradScalerRecipe`, AdamW(foreach=True); {args.iterations} timed iterations per variant "
        f"after {args.warmup} warm-up ones, the variants taking turns iteration by iteration on the same model; "
        f"torch threads: {args.threads}.",
        "",
        f"- lightning {lightning.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} logical cores; load average (1 min) at start {load_start:.2f}, at "
        f"end {load_end:.2f}",
        "- variants: `none` no hooks (automatic optimization, stock); `noop` a no-op "
        "`register_post_accumulate_grad_hook` per parameter and a no-op step pre-hook (torch's price of a Python "
        "hook); `fork` the fork's `watch_unscaled_backward` (16-mixed, manual optimization)",
        "",
        "Medians over iterations; differences to `none` per parameter tensor (the step pre-hook is one call per step, "
        "so its difference is given per step).",
        "",
        "| variant | backward, CPU | backward, wall | per parameter tensor vs none, CPU (wall) | step, CPU | step vs "
        "none, CPU (wall) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    base = med["none"]
    for v in VARIANTS:
        m = med[v]
        per_param = (m["bwd_cpu"] - base["bwd_cpu"]) / n * 1e6, (m["bwd_wall"] - base["bwd_wall"]) / n * 1e6
        step = (m["step_cpu"] - base["step_cpu"]) * 1e6, (m["step_wall"] - base["step_wall"]) * 1e6
        lines.append(
            f"| {v} | {m['bwd_cpu'] * 1e3:.2f} ms | {m['bwd_wall'] * 1e3:.2f} ms | "
            + ("-" if v == "none" else f"{per_param[0]:+.2f} us ({per_param[1]:+.2f} us)")
            + f" | {m['step_cpu'] * 1e3:.2f} ms | "
            + ("-" if v == "none" else f"{step[0]:+.0f} us ({step[1]:+.0f} us)")
            + " |"
        )
    lines.append("")
    for name, stat in (("median", med), ("lower decile", low)):
        fork_bwd = stat["fork"]["bwd_cpu"] - stat["none"]["bwd_cpu"]
        noop_bwd = stat["noop"]["bwd_cpu"] - stat["none"]["bwd_cpu"]
        lines.append(
            f"- {name} of the backward's CPU time: the fork's hooks add {fork_bwd * 1e3:.2f} ms to "
            f"{stat['none']['bwd_cpu'] * 1e3:.2f} ms ({fork_bwd / stat['none']['bwd_cpu'] * 100:+.1f} %), "
            f"{fork_bwd / n * 1e6:.2f} us per parameter tensor; no-op hooks add {noop_bwd / n * 1e6:.2f} us per "
            "parameter tensor (torch's price of calling a Python hook)."
        )
    lines.append("")
    text = "\n".join(lines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
