"""``make gpu-check``: the fork against stock Lightning 2.6.6 and PyTorch's AMP recipe on one CUDA GPU, in at most 8
minutes, written to ``artifacts/gpu-check.md`` and ``artifacts/gpu-check.json``.

Usage::

    python benchmarks/gpu_check.py                      # on a CUDA machine; without one: one line, exit 0
    python benchmarks/gpu_check.py --device cpu --dry-run --out /tmp/x   # the whole pipeline on the CPU, tiny sizes
    python benchmarks/gpu_check.py --probe              # exit 0 if this machine has a CUDA GPU, else say so, exit 1

This driver needs only the standard library (it never imports torch), so it can tell "no GPU here" before any setup.
The check itself runs in ``--python`` (default: this interpreter), which must hold a CUDA build of torch, the fork as
``lightning`` and the unpatched stock 2.6.6 as ``stock_pytorch_lightning``: what ``make setup`` installs
(``make gpu-check`` runs ``make setup`` with a CUDA torch first).

The four parts (``gpu_check_parts.py`` says what each runs) run one after the other, each in its own process with its
own share of the time budget (``--budget``, default 450 s, under the 8 minutes with the start-up around it): a part
that fails or runs out of time is recorded as such, with the rows it wrote before, and the next part still runs. A part
that finishes early leaves its time to the parts after it.

Exit status: 0 when every part completed and no row is FAIL or ERROR (and when there is no GPU); 1 otherwise; the
report is written either way. The parts' own output goes to ``<out>/gpu-check.log``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from gpu_check_report import build_results, write_report

HERE = Path(__file__).resolve().parent

#: the parts in order: (name, title, share of the time budget)
PARTS = (
    ("reports", "1. The two user reports on the device", 0.16),
    ("equivalence", "2. Equivalence with the recipe on the device", 0.26),
    ("cost", "3. Cost: time per step (paired rounds) and host synchronisations per step", 0.44),
    ("watch", "4. The misuse watch on device parameters", 0.14),
)
DEFAULT_BUDGET_S = 450.0
#: kept back from the parts for the preflight and the report
RESERVE_S = 20.0
NO_CUDA = "gpu-check: no CUDA GPU on this machine ({why}); nothing to check, skipped."


def find_gpus() -> tuple[list[str], str]:
    """The CUDA GPUs this machine shows (names), without torch; and, when none, why.

    ``CUDA_VISIBLE_DEVICES`` set to empty or ``-1`` hides every GPU, as it does for CUDA itself. Otherwise
    ``nvidia-smi -L``, or else the driver's ``/proc/driver/nvidia/gpus``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return [], f"CUDA_VISIBLE_DEVICES={visible!r}"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            gpus = [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]
            if gpus:
                return gpus, ""
        except (OSError, subprocess.SubprocessError):
            pass
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir() and any(proc.iterdir()):
        return [p.name for p in proc.iterdir()], ""
    return [], "nvidia-smi lists none" if smi else "no nvidia-smi, no NVIDIA driver"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a part wrote (a line cut off by a kill is dropped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_part(python: str, name: str, device: str, dry_run: bool, timeout: float, workdir: Path, log) -> dict:
    """Run one part in its own process (its own session, so a timeout ends all of it); its result for the report."""
    out = workdir / f"{name}.jsonl"
    cmd = [python, str(HERE / "gpu_check_parts.py"), name, "--device", device, "--out", str(out),
           "--deadline", str(time.time() + max(timeout - 10.0, 1.0))]
    if dry_run:
        cmd.append("--dry-run")
    log.write(f"\n===== part {name}: {' '.join(cmd)} (timeout {timeout:.0f} s)\n")
    log.flush()
    started = time.time()
    # tests/ for the oracle; PYTHONPATH is kept after it: where no package index is reachable, the fork's wheels may be
    # installed into a folder on it
    path = os.pathsep.join(filter(None, (str(HERE.parent / "tests"), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
    status, error = "ok", None
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status, error = "timeout", f"stopped at its share of the budget ({timeout:.0f} s)"
        code = None
    records = read_records(out)
    done = any(r.get("kind") == "done" for r in records)
    if status == "timeout" and done:
        status, error = "ok", None  # its work was done: only its exit hung (a process group, a thread)
        log.write(f"part {name}: finished, then hung at exit and was stopped\n")
    elif status == "ok" and (code != 0 or not done):
        status, error = "error", f"the part's process exited with {code} before its end (see gpu-check.log)"
    return {
        "status": status, "error": error, "elapsed_s": time.time() - started,
        "rows": [{k: v for k, v in r.items() if k != "kind"} for r in records if r.get("kind") == "row"],
        "meta": next((r for r in records if r.get("kind") == "meta"), None),
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, one round: the pipeline, not a measurement")
    p.add_argument("--python", default=sys.executable, help="interpreter with torch, the fork and stock (the parts)")
    p.add_argument("--out", type=Path, default=HERE.parent / "artifacts", help="folder of the report")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all parts together")
    p.add_argument("--parts", default=",".join(name for name, _, _ in PARTS), help="comma-separated subset")
    p.add_argument("--probe", action="store_true", help="only tell whether this machine has a CUDA GPU")
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.dry_run:
        p.error("--device cpu is the pipeline check: add --dry-run")
    wanted = [w.strip() for w in args.parts.split(",") if w.strip()]
    unknown = set(wanted) - {name for name, _, _ in PARTS}
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")

    if args.device == "cuda":
        gpus, why = find_gpus()
        if not gpus:
            print(NO_CUDA.format(why=why))
            return 1 if args.probe else 0
        if args.probe:
            return 0

    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    parts: list[dict] = []
    versions: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, open(args.out / "gpu-check.log", "w") as log:
        workdir = Path(tmp)
        pre = run_part(args.python, "versions", args.device, args.dry_run, 120.0, workdir, log)
        meta = pre["meta"] or {}
        versions = meta.get("versions", {})
        if pre["status"] != "ok" or (args.device == "cuda" and not meta.get("cuda_available")):
            reason = pre["error"] or (
                f"{args.python} has torch {versions.get('torch', '?')}, which sees no CUDA device: a CPU build? "
                "Set up with a CUDA build (make gpu-check GPU_TORCH=<a CUDA torch>)")
            parts.append({"name": "preflight", "title": "Preflight", "status": "error", "error": reason, "rows": []})
        else:
            todo = [(name, title, share) for name, title, share in PARTS if name in wanted]
            for i, (name, title, share) in enumerate(todo):
                left = args.budget - (time.time() - started) - RESERVE_S
                shares_left = sum(s for _, _, s in todo[i:])
                timeout = left * share / shares_left
                if timeout < 15:
                    parts.append({"name": name, "title": title, "status": "skipped", "rows": [],
                                  "error": "the time budget was spent"})
                    continue
                parts.append({"name": name, "title": title,
                              **run_part(args.python, name, args.device, args.dry_run, timeout, workdir, log)})
    results = build_results(
        parts, versions, datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        args.dry_run, args.device, args.budget, time.time() - started,
    )
    md, js = write_report(results, args.out)
    s = results["summary"]
    print(f"gpu-check: {s['PASS']} PASS, {s['FAIL']} FAIL, {s['ERROR']} ERROR, {s['INFO']} INFO, {s['N/A']} N/A; "
          f"{s['parts_failed']} part(s) not completed; {results['elapsed_s']:.0f} s -> {md}, {js}")
    return 0 if s["FAIL"] == 0 and s["ERROR"] == 0 and s["parts_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
