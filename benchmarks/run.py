"""Benchmark the fork against stock ``lightning==2.6.6`` and a hand-written PyTorch loop, as ratios.

Usage and how to read the figures: ``benchmarks/README.md`` (``make bench``; ``--help`` lists the sizes, rounds, steps
and workloads). The runner needs only the standard library and matplotlib, never torch. Every measurement runs through
``worker.py`` (what it measures: its docstring) in its contender's virtual environment (both load the same torch files,
see ``setup.sh``): ``fork`` (``benchmarks/.venvs/fork``), ``stock`` (``benchmarks/.venvs/stock``) and ``raw``, PyTorch's
AMP recipe written out (``workloads.recipe_step``), in the stock environment (it imports only torch).

Workloads (``workloads.py``; sizes by flag, defaults per device in ``sizes.py``), all AdamW: ``mlp`` (nothing reuses a
weight, so fork/stock is what the fork adds per step; A/A rows run stock against stock), ``tied`` and ``rnn``
(bf16-mixed; the fork's automatic optimization keeps autocast's weight cache on, stock hard-codes it off; in manual
optimization both leave it off), ``many`` (1,000 parameter tensors, ``foreach``: per-parameter work shows; its runs time
``--many-steps``) and ``fused`` (16-mixed with clipping: the fork runs ``AdamW(fused=True)``, stock, which refuses to
clip a fused optimizer (checked first), ``fused=False``; on a CPU 16-mixed is an explicit ``MixedPrecision`` with a CPU
``GradScaler``, since the flag alone would become bf16).

``--rounds`` rounds; in each, the runs of one workload start together and, with ``--interleave step`` (the default),
take turns one iteration at a time, the order rotating, so they are timed milliseconds apart under the same load;
``--interleave run`` runs them one after the other. Ratios are formed within a round: the table gives their median, the
smallest and largest round in brackets. Outputs (``--out``, default ``benchmarks/results``; ``-cuda`` suffixed for
``--device cuda``): ``results.md`` (table, targets PASS/FAIL), ``ratios.png``, ``raw.json`` (every step time) and
``run.log``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sizes import DEFAULT_SIZES

HERE = Path(__file__).resolve().parent

CONTENDERS = ("fork", "stock", "raw")
# the table's ratio columns, in order: (metric, denominator) of fork/denominator
TABLE_COLUMNS = (("time", "stock"), ("cpu", "stock"), ("time", "raw"), ("cpu", "raw"), ("mem", "stock"), ("mem", "raw"))
COLUMN_NAMES = {
    (metric, den): f"{name} fork/{den}"
    for metric, name in (("time", "wall time"), ("cpu", "CPU time"), ("mem", "peak mem"))
    for den in ("stock", "raw")
}
WORKLOADS = ("mlp", "tied", "rnn", "fused", "many")
LABELS = {"mlp": "MLP", "tied": "tied layer", "rnn": "RNN cell", "fused": "AdamW+clip", "many": "many small layers"}


@dataclass
class Case:
    """One row of the table: a workload in one precision and optimization mode."""

    workload: str
    precision: str
    mode: str  # "auto", "manual", or "fabric" (a hand-written Fabric loop)
    clip: float = 0.0
    fused: dict = field(default_factory=lambda: {"fork": False, "stock": False, "raw": False})
    foreach: bool | None = None  # AdamW's implementation when not fused (None: torch's default)
    steps: int | None = None  # timed steps per run, when not ``--steps``
    # A/A check: its "fork" is a second run of stock, so its fork/stock ratio shows the method's own noise and bias
    aa: bool = False

    @property
    def name(self) -> str:
        return f"{self.workload} {self.precision} {self.mode}" + (" A/A" if self.aa else "")

    def raw_key(self) -> str:
        # the hand-written loop has no optimization "mode": one raw run serves the auto and manual rows
        return f"{self.workload} {self.precision}"

    def label(self) -> str:
        if self.aa:
            return f"A/A check: stock vs stock, {LABELS[self.workload]}, {self.precision}, automatic"
        mode = {"manual": "manual", "auto": "automatic", "fabric": "Fabric"}[self.mode]
        return f"{LABELS[self.workload]}, {self.precision}, {mode}"


def build_cases(workloads: list[str], clip: float, aa: bool = True, many_steps: int | None = None) -> list[Case]:
    cases: list[Case] = []
    if "mlp" in workloads:
        for precision in ("32", "bf16-mixed", "16-mixed"):
            for mode in ("auto", "manual"):
                cases.append(Case("mlp", precision, mode))
        if aa:
            cases += [Case("mlp", precision, "auto", aa=True) for precision in ("32", "bf16-mixed")]
    for name in ("tied", "rnn"):
        if name in workloads:
            # automatic: the fork's autocast cache on, stock's off; manual: both off (the fork's default there)
            cases += [Case(name, "bf16-mixed", mode) for mode in ("auto", "manual")]
    if "fused" in workloads:
        cases.append(Case("fused", "16-mixed", "auto", clip=clip, fused={"fork": True, "stock": False, "raw": True}))
    if "many" in workloads:
        # foreach AdamW (every contender), so that the optimizer's own per-tensor loop does not drown the rest.
        # 16-mixed in both modes (the fork's per-parameter hooks exist only in manual optimization with a scaler), and
        # bf16-mixed manual: the same mode without a scaler, hence without the hooks
        many = [("16-mixed", "auto"), ("16-mixed", "manual"), ("16-mixed", "fabric"), ("bf16-mixed", "manual")]
        cases += [Case("many", precision, mode, foreach=True, steps=many_steps) for precision, mode in many]
        if aa:
            cases.insert(-1, Case("many", "16-mixed", "auto", foreach=True, steps=many_steps, aa=True))
    return cases


# ---------------------------------------------------------------------------------------------------- contenders
class Orchestra:
    """Starts measurements in the two virtual environments and conducts them over a Unix socket.

    Isolation ``fork``: one fork server per environment (``worker.py --serve``) forks a child per measurement.
    Isolation ``spawn``: a new interpreter per measurement (needed on CUDA). Either way each measurement connects to
    this object's socket and ends with a ``result`` line (see ``worker.Channel``).
    """

    def __init__(self, pythons: dict, isolation: str, log, timeout: float = 900.0) -> None:
        import socket
        import tempfile

        self.pythons, self.isolation, self.log, self.timeout = pythons, isolation, log, timeout
        self.tmp = tempfile.mkdtemp(prefix="lightning-bench-")
        self.path = os.path.join(self.tmp, "runner.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.listener.settimeout(timeout)
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # never the dev tree's lightning
        self.env["PYTHONUNBUFFERED"] = "1"
        self.servers: dict = {}
        self.spawned: list = []
        if isolation == "fork":
            for name, python in pythons.items():
                self.servers[name] = subprocess.Popen(
                    [python, str(HERE / "worker.py"), "--serve"],
                    stdin=subprocess.PIPE, stdout=log, stderr=log, text=True, env=self.env,
                )

    def _start(self, venv: str, spec: dict) -> None:
        if self.isolation == "fork":
            server = self.servers[venv]
            if server.poll() is not None:
                raise RuntimeError(f"the measurement server of {self.pythons[venv]} exited (see the log)")
            server.stdin.write(json.dumps(spec) + "\n")
            server.stdin.flush()
        else:
            self.spawned.append(subprocess.Popen(
                [self.pythons[venv], str(HERE / "worker.py"), json.dumps(spec)],
                stdout=self.log, stderr=self.log, env=self.env,
            ))

    def _connect(self, count: int) -> dict:
        """Accept ``count`` measurements; their line files by run id."""
        lines = {}
        for _ in range(count):
            conn, _ = self.listener.accept()
            conn.settimeout(self.timeout)
            f = conn.makefile("rwb", buffering=0)
            hello = f.readline().decode().rstrip("\n")
            lines[hello.split(" ", 1)[1]] = f
        return lines

    @staticmethod
    def _read(f) -> tuple[str, dict | None]:
        """The next line: ("ready", None), or ("result", payload); a closed line is an error result."""
        line = f.readline().decode()
        if not line:
            return "result", {"error": "the measurement process died (see the log)"}
        if line.startswith("result "):
            return "result", json.loads(line[len("result "):])
        return line.strip(), None

    def _until_result(self, f) -> dict:
        kind, payload = self._read(f)
        while kind != "result":
            kind, payload = self._read(f)
        return payload

    def session(self, runs: list[tuple[str, str, dict]], lockstep: bool, marks: int) -> dict:
        """Run ``runs`` ((run id, venv, spec)), each with ``marks`` iteration marks; their results by run id.

        Lock-step: all start together; once all are ready, they take one iteration each in turn, the order rotating
        from iteration to iteration. Otherwise they run one after the other."""
        results: dict = {}
        for run_id, _venv, spec in runs:
            spec.update(socket=self.path, run_id=run_id, lockstep=lockstep)
        if not lockstep:
            for run_id, venv, spec in runs:
                self._start(venv, spec)
                results[run_id] = self._until_result(self._connect(1)[run_id])
            self._reap()
            return results
        for _run_id, venv, spec in runs:
            self._start(venv, spec)
        lines = self._connect(len(runs))
        active = []
        for run_id, _venv, _spec in runs:
            kind, payload = self._read(lines[run_id])
            if kind == "result":
                results[run_id] = payload
            else:
                active.append(run_id)
        for k in range(marks):
            shift = k % len(active) if active else 0
            for run_id in list(active[shift:] + active[:shift]):
                lines[run_id].write(b"go\n")
                if k == marks - 1:
                    continue  # its last iteration: not timed, no further mark
                kind, payload = self._read(lines[run_id])
                if kind == "result":  # it stopped early (an error)
                    results[run_id] = payload
                    active.remove(run_id)
        for run_id in active:
            results[run_id] = self._until_result(lines[run_id])
        self._reap()
        return results

    def _reap(self) -> None:
        for proc in self.spawned:
            proc.wait()
        self.spawned.clear()

    def close(self) -> None:
        for server in self.servers.values():
            server.stdin.close()
            server.wait(timeout=60)
        self.listener.close()
        os.unlink(self.path)
        os.rmdir(self.tmp)


# ---------------------------------------------------------------------------------------------------- statistics
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Ratio:
    per_round: list[float]

    @property
    def mid(self) -> float:
        return median(self.per_round)

    @property
    def lo(self) -> float:
        return min(self.per_round, default=float("nan"))

    @property
    def hi(self) -> float:
        return max(self.per_round, default=float("nan"))

    def fmt(self) -> str:
        return f"**{self.mid:.3f}** ({self.lo:.2f}-{self.hi:.2f})" if self.per_round else "n/a"


METRIC_KEYS = {"time": "times", "cpu": "cpu_times", "mem": "mem"}


def round_pairs(results: dict, case: Case, num: str, den: str, metric: str, rounds: int) -> list[tuple]:
    """``(num, den)`` figures of ``metric`` in the rounds where both ran and have it: "time", the run's median wall
    time per step; "cpu", its median CPU time per step (CPU only); "mem", its peak memory growth."""
    key, out = METRIC_KEYS[metric], []
    for r in range(rounds):
        a, b = results.get((case.name, num, r)), results.get((case.name, den, r))
        if a and b and "error" not in a and "error" not in b and (metric == "mem" or (a.get(key) and b.get(key))):
            out.append((a[key], b[key]) if metric == "mem" else (median(a[key]), median(b[key])))
    return out


def paired(results: dict, case: Case, num: str, den: str, metric: str, rounds: int) -> Ratio:
    """``num/den`` for ``metric`` round by round."""
    return Ratio([x / y for x, y in round_pairs(results, case, num, den, metric, rounds) if y > 0])


# ---------------------------------------------------------------------------------------------------- reporting
def machine_facts(device: str) -> list[str]:
    facts = [f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"]
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
        flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
        native = [f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "avx_vnni")]
        widest = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "none")
        facts.append(
            f"CPU: {model}, {os.cpu_count()} logical cores, widest vector ISA {widest}; native bf16/fp16 matmul "
            f"instructions: {', '.join(native) or 'none (torch emulates bf16 and fp16 matmuls: much slower than fp32)'}"
        )
    except OSError:
        pass
    return facts


def chart(rows: list[tuple[Case, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("time", "stock", "wall time per step, fork / stock", "#1f77b4"),
        ("cpu", "stock", "CPU time per step, fork / stock", "#9ecae1"),
        ("mem", "stock", "peak memory, fork / stock", "#2ca02c"),
        ("time", "raw", "wall time per step, fork / raw PyTorch", "#ff7f0e"),
    ]
    series = [s for s in series if any(ratios[(s[0], s[1])].per_round for _, ratios in rows)]
    labels = [case.label() for case, _ in rows]
    height = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.62 * len(rows)))
    right = 1.0
    for i, (metric, den, name, color) in enumerate(series):
        ys, mids, errs, tops = [], [], [[], []], []
        for j, (_case, ratios) in enumerate(rows):
            ratio: Ratio = ratios[(metric, den)]
            if not ratio.per_round:
                continue
            ys.append(j + (i - (len(series) - 1) / 2) * height)
            mids.append(ratio.mid)
            errs[0].append(ratio.mid - ratio.lo)
            errs[1].append(ratio.hi - ratio.mid)
            tops.append(ratio.hi)
        ax.barh(ys, mids, height=height, color=color, label=name, xerr=errs, error_kw={"elinewidth": 0.8, "capsize": 2})
        for y, v, top in zip(ys, mids, tops):
            ax.text(top + 0.01, y, f"{v:.2f}", va="center", fontsize=7)
            right = max(right, top)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, right + 0.12)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ratio: median over rounds (bar), smallest and largest round (whiskers); below 1 the fork is faster "
                  "or lighter", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.legend(fontsize=8, loc="lower center", ncol=2)
    fig.tight_layout(rect=(0, 0.9 / (1.8 + 0.62 * len(rows)), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def per_parameter_cost(rows: list[tuple[Case, dict]], results: dict, rounds: int, tensors: int,
                       device: str) -> list[str]:
    """The many-parameter model's fork-minus-stock time per step, in absolute terms and per parameter tensor: what the
    fork does per parameter (under 16-mixed in manual optimization: one gradient hook per parameter per backward and
    one optimizer step pre-hook), next to the rows without it."""
    metric = "cpu" if device == "cpu" else "time"
    cases = [case for case, _ in rows if case.workload == "many"]
    if not cases:
        return []
    out = [
        f"{'CPU' if metric == 'cpu' else 'Wall'} time per step, fork minus stock (per round: the difference of the "
        f"two runs' medians; median over rounds, smallest and largest round in brackets), and that difference per "
        f"parameter tensor ({tensors} tensors). The A/A row is a second stock run minus stock: the run's resolution.",
        "",
        "| row | stock per step | fork - stock per step | per parameter tensor |",
        "| --- | --- | --- | --- |",
    ]
    for case in cases:
        pairs = round_pairs(results, case, "fork", "stock", metric, rounds)
        if not pairs:
            continue
        d, base = Ratio([x - y for x, y in pairs]), median([y for _, y in pairs])
        out.append(
            f"| {case.label()} | {base * 1e3:.1f} ms | {d.mid * 1e3:+.2f} ms ({d.lo * 1e3:+.2f} to "
            f"{d.hi * 1e3:+.2f}) | {d.mid / tensors * 1e6:+.2f} us ({d.lo / tensors * 1e6:+.2f} to "
            f"{d.hi / tensors * 1e6:+.2f}) |"
        )
    return out


def targets(rows: list[tuple[Case, dict]], device: str) -> list[tuple[str, str, str, str, str]]:
    """The issue's targets: (target, measure, criterion, measured, PASS/FAIL), judged on wall time and, on CPU, on CPU
    time too (the steadier measure of the same work on a shared machine)."""
    out = []
    time_metrics = [("time", "wall time")] + ([("cpu", "CPU time")] if device == "cpu" else [])

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    def mostly_below_one(ratio: Ratio) -> bool:
        # the fork ahead in every round but at most one: one round spoilt by a neighbour's burst may not decide
        return sum(v < 1.0 for v in ratio.per_round) >= max(1, len(ratio.per_round) - 1)

    def noise_note(failing: list[Ratio], aa: list) -> str:
        # a miss no larger than what two identical contenders showed in the same run is not evidence of overhead
        worst_aa = max((ratio.hi for _, ratio in aa), default=None)
        if failing and worst_aa is not None and all(ratio.mid <= worst_aa for ratio in failing):
            return f" (but within this run's A/A noise: stock/stock reached {worst_aa:.2f} in a round)"
        return ""

    def spread(ratio: Ratio) -> str:
        return f"{ratio.mid:.3f} (rounds {ratio.lo:.2f}-{ratio.hi:.2f})" if ratio.per_round else "n/a"

    for metric, measure in time_metrics:
        mlp = [(c, r[(metric, "stock")]) for c, r in rows
               if c.workload == "mlp" and not c.aa and r[(metric, "stock")].per_round]
        aa = [(c, r[(metric, "stock")]) for c, r in rows
              if c.aa and c.workload == "mlp" and r[(metric, "stock")].per_round]
        if mlp:
            out.append((
                "MLP: no per-step overhead",
                measure,
                "fork/stock <= 1.02 (median over rounds) in every MLP row",
                ", ".join(f"{c.precision} {c.mode}: {ratio.mid:.3f}" for c, ratio in mlp)
                + ("; A/A stock/stock in the same run: " + ", ".join(f"{c.precision}: {ratio.mid:.3f} "
                   f"({ratio.lo:.2f}-{ratio.hi:.2f})" for c, ratio in aa) if aa else ""),
                verdict(all(ratio.mid <= 1.02 for _, ratio in mlp))
                + noise_note([ratio for _, ratio in mlp if ratio.mid > 1.02], aa),
            ))
    # in manual optimization the fork's cache is off by default, as stock's: no gain expected there
    faster = [(c, r, f"{c.label()}: faster than stock", 0.98) for c, r in rows
              if c.workload in ("tied", "rnn") and c.mode == "auto"]
    faster += [(c, r, "AdamW + clipping, 16-mixed: fused (fork) faster than unfused (stock)", 1.0) for c, r in rows
               if c.workload == "fused"]
    for case, r, what, below in faster:
        for metric, measure in time_metrics:
            t = r[(metric, "stock")]
            out.append((what, measure, f"fork/stock: median < {below:g}, and < 1 in every round but at most one",
                        spread(t), verdict((t.mid < below and mostly_below_one(t)) if t.per_round else None)))
        if case.workload != "fused":
            m = r[("mem", "stock")]
            out.append((f"{case.label()}: lighter than stock", "peak memory growth", "fork/stock: median < 0.95",
                        spread(m), verdict((m.mid < 0.95) if m.per_round else None)))
    return out


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default_venvs = HERE / ".venvs"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 7 on cpu, 3 on cuda)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run, after the warm-up (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each run (default 5)")
    p.add_argument("--many-steps", type=int, default=None,
                   help="timed steps per run of the many-small-layers workload, whose steps are the slowest\n"
                        "(default: half of --steps)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip of the fused workload (default 1.0)")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch threads per measurement (default: 1 on cpu, a busy shared machine is steadier so; 0 = torch's)",
    )
    p.add_argument("--interleave", choices=("step", "run"), default="step",
                   help="step (default): the runs of a workload take turns, one iteration each (on CUDA each turn\n"
                        "ends with a synchronize); run: one whole run after the other (on CUDA timed with CUDA events)")
    p.add_argument("--isolation", choices=("fork", "spawn"), default=None,
                   help="fork: children of a per-venv server (default on cpu); spawn: a new interpreter per run")
    p.add_argument("--fork-python", default=str(default_venvs / "fork" / "bin" / "python"))
    p.add_argument("--stock-python", default=str(default_venvs / "stock" / "bin" / "python"))
    p.add_argument("--no-aa", action="store_true",
                   help="leave out the A/A rows (stock against stock on the MLP), which show the method's noise")
    p.add_argument("--no-version-check", action="store_true",
                   help="accept any lightning in either environment (A/A runs that measure the method's own bias)")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for results.md, ratios.png, raw.json")
    p.add_argument("--quick", action="store_true", help="2 rounds of 10 steps: a smoke test, not a measurement")
    sizes = p.add_argument_group("sizes (defaults depend on --device)")
    for key in DEFAULT_SIZES["cpu"]:
        sizes.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                           help=f"cpu {DEFAULT_SIZES['cpu'][key]}, cuda {DEFAULT_SIZES['cuda'][key]}")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = args.rounds or 2, 10, 3
    args.rounds = args.rounds or (7 if args.device == "cpu" else 3)
    args.many_steps = args.many_steps or max(1, args.steps // 2)
    args.threads = (1 if args.device == "cpu" else 0) if args.threads is None else args.threads
    args.isolation = args.isolation or ("fork" if args.device == "cpu" else "spawn")
    if args.device == "cuda" and args.isolation == "fork":
        p.error("--isolation fork cannot be used with CUDA (a forked child cannot use CUDA); use spawn")
    defaults = DEFAULT_SIZES[args.device]
    args.sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in defaults.items()}
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for python in (args.fork_python, args.stock_python):
        if not Path(python).exists():
            sys.exit(f"{python} does not exist: run `bash benchmarks/setup.sh` first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device == "cpu" else f"-{args.device}"
    log_path = out / f"run{suffix}.log"
    cases = build_cases(args.workloads, args.clip, aa=not args.no_aa, many_steps=args.many_steps)
    command = "benchmarks/.venvs/fork/bin/python benchmarks/run.py" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    started = time.time()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None

    with open(log_path, "w") as log:
        orchestra = Orchestra({"fork": args.fork_python, "stock": args.stock_python}, args.isolation, log)
        venv_of = {"fork": "fork", "stock": "stock", "raw": "stock"}

        def spec_for(case: Case, contender: str, **over) -> dict:
            return {"impl": "raw" if contender == "raw" else "lightning", "workload": case.workload,
                    "precision": case.precision, "mode": case.mode, "fused": case.fused[contender],
                    "foreach": case.foreach, "clip": case.clip, "device": args.device, "warmup": args.warmup,
                    "steps": case.steps or args.steps, "threads": args.threads, "sizes": args.sizes, **over}

        # the premise of the fused workload: stock refuses to clip with a fused optimizer
        premise = None
        fused_case = next((c for c in cases if c.workload == "fused"), None)
        if fused_case is not None:
            res = orchestra.session([("premise", "stock", spec_for(fused_case, "fork", warmup=0, steps=1))], False, 2)
            premise = res["premise"].get("error", "stock ran AdamW(fused=True) with clipping without an error")

        # sessions: the runs that take turns; the MLP rows of one precision share one raw loop
        sessions: list[list[tuple[Case, str]]] = []
        for case in cases:
            same = next((s for s in sessions if s[-1][0].raw_key() == case.raw_key()), None)
            # an A/A row runs one more stock and compares it with its precision's automatic stock run
            runs = [(case, "fork")] if case.aa else [(case, "fork"), (case, "stock")]
            if same is None:
                sessions.append(runs + [(case, "raw")])
            else:
                same[:0] = runs
        results: dict = {}
        versions: dict = {}
        n_runs = 0
        for r in range(args.rounds):
            for i, session in enumerate(sessions):
                shift = (r + i) % len(session)
                order = session[shift:] + session[:shift]  # who starts, and who goes first in free-running order
                runs = [(f"{c.name}|{who}", "stock" if c.aa else venv_of[who], spec_for(c, who)) for c, who in order]
                marks = args.warmup + (session[0][0].steps or args.steps) + 1  # one session, one step count
                done = orchestra.session(runs, args.interleave == "step", marks)
                n_runs += len(runs)
                for case, who in order:
                    res = done[f"{case.name}|{who}"]
                    if "error" in res:
                        print(f"  round {r + 1} {case.name} {who}: ERROR {res['error']}", file=sys.stderr)
                    elif not case.aa:
                        versions[who] = (res.get("lightning"), res.get("torch"))
                    # the raw run serves every row of its key; an automatic stock run the A/A rows of its precision
                    same = [c for c in cases if c.raw_key() == case.raw_key()]
                    for row in {"raw": [c for c in same if not c.aa],
                                "stock": [case] + [c for c in same if c.aa and case.mode == "auto"]}.get(who, [case]):
                        results[(row.name, who, r)] = res
            print(f"round {r + 1}/{args.rounds} done ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
        orchestra.close()

    # the environments must be what they claim to be
    fork_v, stock_v = versions.get("fork", (None,))[0], versions.get("stock", (None,))[0]
    if not args.no_version_check:
        if fork_v and "+" not in fork_v:
            sys.exit(f"the fork environment runs lightning {fork_v}, not the fork")
        if stock_v and stock_v != "2.6.6":
            sys.exit(f"the stock environment runs lightning {stock_v}, not 2.6.6")

    rows = [(case, {(metric, den): paired(results, case, "fork", den, metric, args.rounds)
                    for metric in METRIC_KEYS for den in ("stock", "raw")}) for case in cases]
    elapsed = time.time() - started
    load_end = os.getloadavg() if hasattr(os, "getloadavg") else None

    sz = args.sizes
    descr = {
        "mlp": f"MLP {sz['mlp_depth']} x Linear({sz['mlp_width']}), batch {sz['mlp_batch']}",
        "tied": f"one Linear({sz['tied_width']}) applied {sz['tied_repeats']} times, batch {sz['tied_batch']}",
        "rnn": f"RNNCell({sz['rnn_hidden']}) unrolled over {sz['rnn_steps']} steps, batch {sz['rnn_batch']}",
        "fused": f"MLP {sz['fused_depth']} x Linear({sz['fused_width']}), batch {sz['fused_batch']}, AdamW, "
        f"clip_grad_norm {args.clip}: fork fused=True, stock fused=False, raw fused=True",
        "many": f"{sz['many_layers']} x (Linear({sz['many_width']}) + tanh), {2 * sz['many_layers']} parameter "
        f"tensors, batch {sz['many_batch']}, AdamW(foreach=True)",
    }

    def cache_of(case: Case, contender: str) -> str:
        vals = {results[(case.name, contender, r)].get("autocast_cache") for r in range(args.rounds)
                if (case.name, contender, r) in results and "error" not in results[(case.name, contender, r)]}
        vals.discard(None)
        return "/".join(sorted("on" if v else "off" for v in vals)) or "-"

    columns = [key for key in TABLE_COLUMNS if args.device == "cpu" or key[0] != "cpu"]
    lines = [
        f"# Benchmarks: the fork against stock Lightning 2.6.6 and a hand-written PyTorch loop ({args.device})",
        "",
        "Produced by:",
        "",
        "```bash",
        "bash benchmarks/setup.sh",
        command,
        "```",
        "",
        f"Run of {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"{elapsed / 60:.1f} min, {n_runs} measurements in {args.rounds} interleaved rounds; each run: "
        f"{args.warmup} warm-up steps, then the median of {args.steps} timed steps"
        + (f" ({LABELS['many']}: {args.many_steps})" if "many" in args.workloads else "") + "; "
        f"torch threads per run: {args.threads or 'torch default'}; interleaving: "
        + ("iteration by iteration (lock-step)" if args.interleave == "step" else "run after run")
        + f"; isolation: {args.isolation}.",
        "",
        f"- fork: lightning {fork_v}; stock: lightning {stock_v}; torch {versions.get('stock', (None, None))[1]}",
        *[f"- {fact}" for fact in machine_facts(args.device)],
    ]
    if load_start and load_end:
        lines.append(
            f"- load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f}: the machine is shared, "
            "which is why only ratios of runs made seconds apart are reported"
        )
    lines += [
        "",
        "Ratios: median over rounds of the per-round ratio (smallest-largest round in brackets). Step time: median "
        "interval between the starts of consecutive training iterations after warm-up. Peak memory: growth of the peak "
        + ("resident set (VmHWM)" if args.device == "cpu" else "of torch.cuda.max_memory_allocated")
        + " from the start of training. Below 1: the fork is faster / lighter.",
        "",
        "| workload | autocast cache fork / stock | " + " | ".join(COLUMN_NAMES[key] for key in columns) + " |",
        "| --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for case, ratios in rows:
        lines.append(
            f"| {case.label()} | {cache_of(case, 'fork')} / {cache_of(case, 'stock')} | "
            + " | ".join("-" if case.aa and key[1] == "raw" else ratios[key].fmt() for key in columns)
            + " |"
        )
    lines += ["", "Workloads (all AdamW):", ""]
    lines += [f"- {w}: {descr[w]}" for w in args.workloads]
    lines += ["", "## Targets", ""]
    if args.device == "cpu":
        lines += [
            "The issue states its targets in wall time. On a shared machine wall time also measures the other "
            "processes; CPU time (``process_time``) measures only the run's own work, so both are judged.",
            "",
        ]
    lines += ["| target | measure | criterion | measured | verdict |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} | **{e}** |" for a, b, c, d, e in targets(rows, args.device)]
    per_param = per_parameter_cost(rows, results, args.rounds, 2 * sz["many_layers"], args.device)
    if per_param:
        lines += ["", "## Per-parameter work (many small layers)", ""] + per_param
    if premise is not None:
        lines += [
            "",
            "Why stock runs the fused workload unfused: stock 2.6.6 with `AdamW(fused=True)` and gradient clipping "
            f"under 16-mixed stops with `{premise.splitlines()[0]}`",
        ]
    errors = [(k, v["error"]) for k, v in results.items() if "error" in v]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {k}: `{e}`" for k, e in errors]
    chart_name = f"ratios{suffix}.png"
    lines += ["", f"![ratios]({chart_name})", "", "## Reading the figures", ""]
    lines += [
        "- The A/A rows run stock against stock exactly as fork runs against stock: how far their ratios stray from "
        "1 is the resolution of this run; a fork/stock ratio inside that band is no evidence of a difference.",
        "- fork/raw compares the fork's Trainer with the hand-written loop doing the same work: what remains above 1 "
        "is the Trainer's own per-step work (hooks, closures, the precision plugin, the data fetcher), which stock "
        "pays alike.",
        "- Peak memory is the growth of the peak during training; for the MLP it is mostly optimizer state and "
        "allocator noise, while in the weight-reusing models stock also keeps one low-precision copy of each reused "
        "weight per use for the backward pass.",
        "- Tied layer and RNN cell in manual optimization: there the fork leaves autocast's weight cache off by "
        "default (a `training_step` may edit weights in place between two forwards, which the cache cannot see), as "
        "stock does: both cast every reused weight at every use, so fork/stock is expected at 1, with none of the "
        "automatic rows' gain (pass `MixedPrecision(..., cache_enabled=True)` to get it back).",
        "- Many small layers: 1,000 tiny parameter tensors, so that work done per parameter shows. By default the "
        "fork adds none (its misuse watch, which hooks every parameter, is opt-in: `watch_misuse=True`); in the "
        "automatic row the fork's autocast cache is on, which a model that uses each weight once only pays for.",
    ]
    if args.device == "cpu":
        lines.append(
            "- On a CPU without native bf16/fp16 matmul instructions, torch emulates the low-precision matmuls, which "
            "then dwarf the weight casts that autocast's cache saves: the cache's time gain is larger on CPUs with "
            "native bf16 and on GPUs, where a cast is a memory-bound pass over the weight; its memory gain is not "
            "affected."
        )
        cuda_report = out / "results-cuda.md"
        lines += ["", "## GPU variant", ""]
        if cuda_report.exists():
            lines.append("See [results-cuda.md](results-cuda.md).")
        else:
            lines.append(
                "Not run for these results: no GPU was available where they were made. On a machine with CUDA, "
                "`bash benchmarks/setup.sh && benchmarks/.venvs/fork/bin/python benchmarks/run.py --device cuda` "
                "writes `results-cuda.md` and `ratios-cuda.png` here (larger default sizes, one new interpreter per "
                "measurement, each turn ending with `torch.cuda.synchronize()`; `--interleave run` times whole runs "
                "with CUDA events instead)."
            )
    lines.append("")
    report = out / f"results{suffix}.md"
    report.write_text("\n".join(lines))
    chart(rows, out / chart_name, f"fork vs stock Lightning 2.6.6 and raw PyTorch ({args.device}, torch "
          f"{versions.get('stock', (None, '?'))[1]}, {args.rounds} rounds)")
    raw = {
        "args": {k: v for k, v in vars(args).items()},
        "runs": [
            {"case": k[0], "contender": k[1], "round": k[2],
             **({"error": v["error"]} if "error" in v else {
                 "median_step_s": median(v["times"]), "step_times_s": v["times"],
                 "median_step_cpu_s": median(v["cpu_times"]) if v.get("cpu_times") else None,
                 "step_cpu_times_s": v.get("cpu_times"), "peak_mem_growth_bytes": v["mem"],
                 "mem_method": v.get("mem_method"), "lightning": v.get("lightning"), "torch": v.get("torch"),
                 "autocast_cache": v.get("autocast_cache")})}
            for k, v in results.items()
        ],
    }
    (out / f"raw{suffix}.json").write_text(json.dumps(raw, indent=1))
    print(report.read_text())
    print(f"wrote {report}, {out / chart_name}, {out / f'raw{suffix}.json'} (log: {log_path})", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
