#!/usr/bin/env python3
"""Run upstream Lightning's own tests for the areas the fork touches, against the fork and against stock 2.6.6.

    python3 tools/upstream/upstream_test.py --upstream ../pytorch-lightning [--ref 2.6.6]     (make upstream-test ...)

1. Two virtual environments (default ``tools/upstream/.venvs/``, ignored by git), both with ``torch==2.13.0`` (CPU)
   and the test requirements of ``tools/upstream/requirements-test.txt``: ``stock`` with ``lightning==2.6.6`` from
   the package index, ``fork`` with this repository's two distributions built and installed (``pip install <repo>
   <repo>/packaging/pytorch-lightning``, reinstalled on every run so the run tests the checkout as it is).
2. Upstream's ``tests/`` (and its ``pyproject.toml``, which holds the pytest configuration) at ``--ref`` are
   exported with ``git archive`` into two trees under ``--workdir`` (default ``tools/upstream/results/``): upstream's
   ``src/`` is never there, so the venv's installed ``lightning`` is what is tested (checked before running).
   The fork's tree gets ``tools/upstream/test-patches/`` applied: upstream tests that pin behaviour our patches
   change on purpose, updated.
3. The selected test files (the areas we touch, plus every test file that mentions ``MixedPrecision``,
   ``GradScaler``, ``manual_backward``, ``clip_gradients`` or ``autocast``) run in each venv from the tree's
   ``tests/`` folder with pytest (``-n`` workers, a per-test timeout), writing junit XML.
4. Per-test outcomes are compared. The report (stdout and ``<workdir>/report.md``, ``summary.json``) gives the counts
   and every test that passes on stock and fails on the fork. Tests a test patch changes are listed apart.

Exit status: 0 when no test passes on stock and fails on the fork, 1 when some do, 2 when it could not run.
Standard library only; needs network access to the package index for the first venv setup (CI cannot reach
upstream's repository, so this is a maintainer's command, not part of .ci/run).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import HERE, REPO, TEST_PATCHES, Failure, git, read_series  # noqa: E402

TORCH = "torch==2.13.0"
STOCK = ["lightning==2.6.6", "pytorch-lightning==2.6.6"]
REQUIREMENTS = HERE / "requirements-test.txt"
KEYWORDS = ("MixedPrecision", "GradScaler", "manual_backward", "clip_gradients", "autocast")
# The areas our patches touch (amp.py, precision.py, core/optimizer.py, training_epoch_loop.py, callbacks/__init__.py)
AREAS = (
    "tests_pytorch/plugins/precision",
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/core/test_lightning_module.py",
    "tests_pytorch/core/test_lightning_optimizer.py",
    "tests_pytorch/loops/optimization",
    "tests_pytorch/loops/test_training_epoch_loop.py",
    "tests_pytorch/loops/test_training_loop.py",
    "tests_pytorch/loops/test_loops.py",
    "tests_pytorch/trainer/connectors/test_accelerator_connector.py",
    "tests_pytorch/callbacks/test_lr_monitor.py",
    "tests_fabric/plugins/precision",
)
SEARCHED = ("tests_pytorch", "tests_fabric")
FAILED = ("failed", "error")


def log(message: str) -> None:
    print(f"[upstream-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise Failure(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{tail}")
    return done


# --- environments ----------------------------------------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(venv: Path, extra: list[str], stamp_extra: str) -> Path:
    """A venv with torch, the test requirements and ``extra``; reinstalled only when the pins change."""
    python = venv_python(venv)
    stamp = venv / ".upstream-test-deps"
    want = hashlib.sha256((TORCH + REQUIREMENTS.read_text(encoding="utf-8") + stamp_extra).encode()).hexdigest()
    if python.exists() and stamp.is_file() and stamp.read_text().strip() == want:
        return python
    if not python.exists():
        log(f"creating {venv}")
        run([sys.executable, "-m", "venv", str(venv)])
    log(f"installing {TORCH}, the test requirements and {' '.join(extra)} into {venv.name}")
    run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", TORCH, "-r", str(REQUIREMENTS)])
    run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *extra, TORCH])
    stamp.write_text(want + "\n")
    return python


def setup_venvs(venvs: Path, repo: Path, which: list[str]) -> dict[str, Path]:
    pythons = {}
    if "stock" in which:
        pythons["stock"] = ensure_venv(venvs / "stock", STOCK, " ".join(STOCK))
    if "fork" in which:
        # both distributions of the fork: lightning pins its companion, the patched pytorch-lightning
        fork = [str(repo), str(repo / "packaging" / "pytorch-lightning")]
        python = ensure_venv(venvs / "fork", fork, "fork v2")
        log(f"reinstalling the fork from {repo}")
        run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--force-reinstall",
             "--no-deps", *fork])
        pythons["fork"] = python
    return pythons


def installed_lightning(python: Path, cwd: Path) -> dict[str, str]:
    """Which ``lightning`` the venv imports from the test folder; refuse a source tree on sys.path."""
    probe = (
        "import json, sys, lightning, torch; "
        "print(json.dumps({'lightning': lightning.__version__, 'file': lightning.__file__, "
        "'torch': torch.__version__, 'python': sys.version.split()[0]}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    info = json.loads(run([str(python), "-c", probe], cwd=cwd, env=env).stdout.strip().splitlines()[-1])
    if "site-packages" not in info["file"]:
        raise Failure(f"{python} imports lightning from {info['file']}, not from its site-packages")
    return info


# --- test trees ------------------------------------------------------------------------------------------------------


def export_tests(checkout: Path, ref: str, target: Path) -> str:
    """``tests/`` and ``pyproject.toml`` of ``ref`` into ``target`` (a fresh git repo, so patches apply with git)."""
    commit = git(checkout, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False).stdout.strip()
    if not commit:
        raise Failure(
            f"{checkout} has no ref {ref!r}; pass --ref (a tag such as 2.6.6, a branch or a commit) that is the"
            " release the fork is built from"
        )
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    data = subprocess.run(["git", "-C", str(checkout), "archive", "--format=tar", commit, "tests", "pyproject.toml"],
                          capture_output=True, check=False)
    if data.returncode != 0:
        raise Failure(f"git archive {ref} failed in {checkout}:\n{data.stderr.decode(errors='replace')}")
    with tarfile.open(fileobj=io.BytesIO(data.stdout)) as archive:
        archive.extractall(target, filter="data") if hasattr(tarfile, "data_filter") else archive.extractall(target)
    git(target, "init", "-q")
    git(target, "add", "-A")
    git(target, "-c", "user.name=upstream-test", "-c", "user.email=upstream-test@localhost", "-c",
        "commit.gpgsign=false", "commit", "-q", "-m", f"upstream tests at {ref} ({commit[:10]})")
    return commit


def apply_test_patches(tree: Path) -> dict[str, list[str]]:
    """Apply tools/upstream/test-patches/ to a test tree; returns patch name -> files it changes."""
    applied = {}
    for patch in read_series(TEST_PATCHES):
        done = git(tree, "apply", "--index", str(patch.path), check=False)
        if done.returncode != 0:
            raise Failure(f"test patch {patch.name} does not apply to upstream's tests:\n{done.stderr.strip()}")
        applied[patch.name] = patch.targets()
    return applied


def select_tests(tests_dir: Path, extra: list[str]) -> list[str]:
    """The test files to run, relative to ``tests/``."""
    chosen: set[str] = set()
    for area in [*AREAS, *extra]:
        path = tests_dir / area
        if path.is_dir():
            chosen.update(p.relative_to(tests_dir).as_posix() for p in path.rglob("test_*.py"))
        elif path.is_file():
            chosen.add(area)
        else:
            log(f"note: {area} is not in this upstream revision; skipped")
    pattern = re.compile("|".join(map(re.escape, KEYWORDS)))
    for top in SEARCHED:
        for path in (tests_dir / top).rglob("test_*.py"):
            if pattern.search(path.read_text(encoding="utf-8", errors="replace")):
                chosen.add(path.relative_to(tests_dir).as_posix())
    return sorted(chosen)


# --- running and comparing -------------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    python: Path
    tree: Path
    junit: Path
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    lightning: dict[str, str] = field(default_factory=dict)
    returncode: int = 0


def run_pytest(job: Run, files: list[str], workers: int, timeout: int, extra_args: list[str]) -> None:
    tests_dir = job.tree / "tests"
    job.lightning = installed_lightning(job.python, tests_dir)
    log(f"{job.name}: lightning {job.lightning['lightning']} ({job.lightning['file']}), torch {job.lightning['torch']}")
    cmd = [str(job.python), "-m", "pytest", *files, "-p", "no:cacheprovider", "-p", "no:randomly",
           "--color=no", "-q", "-rN", f"--timeout={timeout}", f"--junitxml={job.junit}", "-o", "junit_family=xunit1",
           "-o", "console_output_style=classic"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    cmd += extra_args
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "PL_RUN_CUDA_TESTS": "0", "PYTHONDONTWRITEBYTECODE": "1",
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    log(f"{job.name}: pytest on {len(files)} files with {workers} worker(s), timeout {timeout}s per test")
    start = time.monotonic()
    with open(job.junit.with_suffix(".log"), "w", encoding="utf-8") as out:
        done = subprocess.run(cmd, cwd=tests_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
    job.seconds = time.monotonic() - start
    job.returncode = done.returncode
    if not job.junit.is_file():
        log_file = job.junit.with_suffix(".log")
        raise Failure(f"{job.name}: pytest wrote no junit XML (exit {done.returncode}); see {log_file}")
    job.outcomes, job.messages = read_junit(job.junit)
    log(f"{job.name}: {format_counts(counts(job.outcomes))} in {job.seconds:.0f}s")


def read_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    outcomes, messages = {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                message = (child.get("message") or child.text or "").strip()
                break
            if child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if "xfail" in kind else "skipped"
                message = (child.get("message") or "").strip()
        # a test can appear twice (a teardown error after a pass): keep the worse outcome
        if test_id not in outcomes or outcome in FAILED:
            outcomes[test_id] = outcome
            messages[test_id] = message
    return outcomes, messages


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "xfailed": 0}
    for outcome in outcomes.values():
        out[outcome] = out.get(outcome, 0) + 1
    out["total"] = len(outcomes)
    return out


def format_counts(c: dict[str, int]) -> str:
    return (f"{c['total']} tests: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
            f"{c['skipped']} skipped, {c['xfailed']} xfailed")


def module_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def patched_modules(applied: dict[str, list[str]]) -> set[str]:
    """Dotted module names (as junit's classname starts) of the test files the test patches change."""
    out = set()
    for files in applied.values():
        for name in files:
            if name.startswith("tests/") and name.endswith(".py"):
                dotted = name[: -len(".py")].replace("/", ".")
                out |= {dotted, dotted[len("tests.") :]}  # junit's classname starts at pytest's rootdir
    return out


def compare(stock: Run, fork: Run, patched: set[str]) -> dict:
    def in_patched(test_id: str) -> bool:
        return any(module_of(test_id) == m or module_of(test_id).startswith(m + ".") for m in patched)

    regressions, changed, fixed, missing = [], [], [], []
    for test_id, before in sorted(stock.outcomes.items()):
        after = fork.outcomes.get(test_id)
        if after is None:
            (changed if in_patched(test_id) else missing).append(test_id)
        elif before == "passed" and after in FAILED:
            regressions.append(test_id)
        elif before in FAILED and after == "passed":
            fixed.append(test_id)
    new = sorted(t for t in fork.outcomes if t not in stock.outcomes)
    in_files = [t for t in sorted(set(stock.outcomes) | set(fork.outcomes)) if in_patched(t)]
    patched_tests = [f"{t} (stock: {stock.outcomes.get(t, '-')}, fork: {fork.outcomes.get(t, '-')})"
                     for t in in_files if stock.outcomes.get(t) != fork.outcomes.get(t)]
    return {"regressions": regressions, "fixed_on_fork": fixed, "absent_on_fork": missing,
            "replaced_by_test_patches": changed, "new_on_fork": new, "in_test_patched_files": patched_tests,
            "same_in_test_patched_files": len(in_files) - len(patched_tests)}


def write_report(workdir: Path, ref: str, commit: str, runs: list[Run], result: dict, applied: dict) -> str:
    lines = ["# Upstream tests: stock lightning 2.6.6 vs the fork", "",
             f"Upstream tests at `{ref}` ({commit[:10]}), {len(runs[0].outcomes)} test ids collected on stock.", ""]
    lines += ["| run | lightning | passed | failed | errors | skipped | xfailed | total | time |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for job in runs:
        c = counts(job.outcomes)
        took = f"{job.seconds:.0f}s" if job.seconds else "reused"
        lines.append(f"| {job.name} | {job.lightning.get('lightning', '?')} | {c['passed']} | {c['failed']} | "
                     f"{c['error']} | {c['skipped']} | {c['xfailed']} | {c['total']} | {took} |")
    lines.append("")
    stock = runs[0]
    needs_gpu = [t for t, o in stock.outcomes.items() if o == "skipped" and "GPU" in stock.messages.get(t, "")]
    lines.append(f"Skipped here because they need CUDA GPUs (not evidence either way): {len(needs_gpu)} test ids;"
                 " the rest of the skips need TPUs, MPS, DeepSpeed, standalone (multi-process) runs or other extras.")
    lines.append("")
    if applied:
        lines.append("Test patches applied to the fork's tree (upstream tests that pin the old behaviour, updated):")
        lines += [f"- {name}: {', '.join(files)}" for name, files in applied.items()]
        lines.append("")
    fork = runs[1] if len(runs) > 1 else None
    for key, title in (("regressions", "Pass on stock, fail on the fork"),
                       ("fixed_on_fork", "Fail on stock, pass on the fork"),
                       ("in_test_patched_files",
                        "Tests in files a test patch changes, whose outcome differs (the fork runs the new version)"),
                       ("replaced_by_test_patches", "Stock test ids a test patch replaced (renamed or removed)"),
                       ("new_on_fork", "Test ids only on the fork's run (added or renamed by a test patch)"),
                       ("absent_on_fork", "Stock test ids the fork's run did not report")):
        items = result.get(key, [])
        lines.append(f"## {title}: {len(items)}")
        lines.append("")
        for test_id in items:
            note = ""
            if fork is not None and key == "regressions":
                first = (fork.messages.get(test_id) or "").strip().splitlines()[:1]
                note = f"  \n  `{first[0][:300]}`" if first else ""
            lines.append(f"- {test_id}{note}")
        if key == "in_test_patched_files":
            lines.append(f"- and {result.get('same_in_test_patched_files', 0)} test ids in those files with the same"
                         " outcome on both")
        lines.append("")
    text = "\n".join(lines)
    (workdir / "report.md").write_text(text, encoding="utf-8")
    summary = {"ref": ref, "commit": commit, "runs": {j.name: {"counts": counts(j.outcomes), "lightning": j.lightning,
                                                              "seconds": round(j.seconds), "returncode": j.returncode}
                                                     for j in runs}, "test_patches": applied, **result}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, type=Path, help="an upstream Lightning git checkout")
    parser.add_argument("--ref", default="2.6.6", help="the upstream revision whose tests run (default: 2.6.6)")
    parser.add_argument("--venvs", type=Path, default=HERE / ".venvs", help="where the two venvs live")
    parser.add_argument("--workdir", type=Path, default=HERE / "results", help="test trees, junit XML, report")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (1: no xdist)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--only", choices=["stock", "fork"], help="run one side only (no comparison)")
    parser.add_argument("--no-test-patches", action="store_true", help="run the fork on upstream's tests as they are")
    parser.add_argument("--reuse-stock", action="store_true",
                        help="reuse the last stock run's results (same upstream commit, selection and pins)")
    parser.add_argument("--tests", nargs="*", default=[], help="extra test files or folders (relative to tests/)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    args = parser.parse_args(argv)

    checkout = args.upstream.expanduser().resolve()
    workdir = args.workdir.resolve()
    which = [args.only] if args.only else ["stock", "fork"]
    try:
        if not (checkout / ".git").exists():
            raise Failure(f"{checkout} is not a git checkout of upstream Lightning")
        workdir.mkdir(parents=True, exist_ok=True)
        pythons = setup_venvs(args.venvs.resolve(), REPO, which)
        trees = {name: workdir / f"{name}-tree" for name in which}
        commit = ""
        for name, tree in trees.items():
            commit = export_tests(checkout, args.ref, tree)
        applied = {}
        if "fork" in trees and not args.no_test_patches:
            applied = apply_test_patches(trees["fork"])
        selection_tree = trees.get("stock", next(iter(trees.values())))
        files = select_tests(selection_tree / "tests", args.tests)
        (workdir / "selected.txt").write_text("\n".join(files) + "\n", encoding="utf-8")
        log(f"{len(files)} test files selected (list in {workdir / 'selected.txt'})")
        runs = [Run(name, pythons[name], trees[name], workdir / f"{name}.xml") for name in which]
        extra = args.pytest_args.split()
        key = hashlib.sha256(f"{commit} {files} {extra} {REQUIREMENTS.read_text()}".encode()).hexdigest()
        for job in runs:
            stamp = job.junit.with_suffix(".key")
            if job.name == "stock" and args.reuse_stock and job.junit.is_file() and stamp.is_file() \
                    and stamp.read_text().strip() == key:
                job.outcomes, job.messages = read_junit(job.junit)
                job.lightning = installed_lightning(job.python, job.tree / "tests")
                log(f"stock: reusing {job.junit} ({format_counts(counts(job.outcomes))})")
                continue
            stamp.unlink(missing_ok=True)
            run_pytest(job, files, args.workers, args.timeout, extra)
            stamp.write_text(key + "\n")
    except Failure as err:
        print(f"upstream_test: {err}", file=sys.stderr)
        return 2
    if len(runs) == 1:
        print(format_counts(counts(runs[0].outcomes)))
        return 0
    result = compare(runs[0], runs[1], patched_modules(applied))
    print(write_report(workdir, args.ref, commit, runs, result, applied))
    return 1 if result["regressions"] else 0


if __name__ == "__main__":
    sys.exit(main())
