"""Run upstream Lightning's own tests against the fork: upstream's suites (stock vs fork), and each stack PR's tests.

    python3 -m upstream.upstream_test --upstream ../pytorch-lightning [--ref 2.6.5] [--full]  (make upstream-test ...)
    python3 -m upstream.upstream_test --upstream ../pytorch-lightning --stack [--ref 2.6.5] (make upstream-test STACK=1)
    python3 -m upstream.upstream_test --upstream ../pytorch-lightning --branch amp/<slug> [--base master]

**Stock vs fork** (the first form, steps 1-4 below) tests the fork as it installs: every upstream test the fork fails
that passes on stock must be in a file that a test patch (``upstream/test-patches/``) changes on purpose; the report
lists every failure on the fork as owned (by which test patch) or not. **Stack** (``--stack``) runs each stack PR's
tests against the installed fork: the test hunks of ``upstream/stack/*/changes.patch``, in merge order, are merged into
the fork's test tree (upstream's tests at ``--ref`` with the test patches), each file 3-way against master's version of
it (from the clone; conflicting regions take the PR's side), and the tests each PR adds or changes run in the fork's
venv: what upstream would get must pass here too. **Base vs branch** (``--branch``) runs a stack branch that
``make pr-stack`` built in the clone (``amp/<slug>`` alone, or ``amp/stack-in-order``) from source against its merge
base with ``--base`` (master): one venv (``source``: torch, requirements-test.txt and requirements-source.txt, no
lightning installed), and each run puts its own tree's ``src/`` on ``PYTHONPATH`` with that tree's ``tests/``; the test
files the branch adds or changes are its own, reported apart. ``--full`` runs the whole CPU suites (``tests_pytorch``,
``tests_fabric``) instead of the touched areas.

1. Two virtual environments (default ``upstream/.venvs/``, ignored by git), both with ``torch==2.13.0`` (CPU)
   and the test requirements of ``upstream/requirements-test.txt``: ``stock`` with ``lightning==2.6.6`` from
   the package index, ``fork`` with this repository's two distributions built and installed (``pip install <repo>
   <repo>/packaging/pytorch-lightning``, reinstalled on every run so the run tests the checkout as it is).
2. Upstream's ``tests/`` (and its ``pyproject.toml``, which holds the pytest configuration) at ``--ref`` are
   exported with ``git archive`` into two trees under ``--workdir`` (default ``upstream/results/``): upstream's
   ``src/`` is never there, so the venv's installed ``lightning`` is what is tested (checked before running).
   The fork's tree gets ``upstream/test-patches/`` applied: upstream tests that pin behaviour our patches
   change on purpose, updated.
3. The selected test files (the areas we touch, plus every test file that mentions ``MixedPrecision``,
   ``GradScaler``, ``manual_backward``, ``clip_gradients`` or ``autocast``) run in each venv from the tree's
   ``tests/`` folder with pytest (``-n`` workers, a per-test timeout), writing junit XML.
4. Per-test outcomes are compared. The report (stdout and ``<workdir>/report.md``, ``summary.json``) gives the counts
   and every test that passes on stock and fails on the fork. Tests a test patch changes are listed apart.

Exit status: 0 when no test passes on stock (base) and fails on the fork (branch) and every stack PR's test passes on
the fork, 1 when some do not, 2 when it could not run. Standard library only; needs network access to the package index
for the first venv setup (CI cannot reach upstream's repository, so this is a maintainer's command, not in .ci/run).
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
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from forkbuild.series import REPO, TEST_PATCHES, Failure, git, read_series

HERE = Path(__file__).resolve().parent

TORCH = "torch==2.13.0"
STOCK = ["lightning==2.6.6", "pytorch-lightning==2.6.6"]
REQUIREMENTS = HERE / "requirements-test.txt"
# base vs branch: upstream's src/ runs from PYTHONPATH, so lightning's own dependencies (and the full suites' extras)
SOURCE_REQUIREMENTS = HERE / "requirements-source.txt"
# what a source run exports from each revision (src/version.info is where lightning/__version__.py reads the version)
SOURCE_PATHS = ("src/lightning", "src/version.info", "tests", "pyproject.toml")
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
SUITES = SEARCHED  # --full runs these whole, and the report counts per suite
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


_PROBE = (
    "import json, sys, lightning, torch; "
    "print(json.dumps({'lightning': lightning.__version__, 'file': lightning.__file__, "
    "'torch': torch.__version__, 'python': sys.version.split()[0]}))"
)


def installed_lightning(python: Path, cwd: Path) -> dict[str, str]:
    """Which ``lightning`` the venv imports from the test folder; refuse a source tree on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    info = json.loads(run([str(python), "-c", _PROBE], cwd=cwd, env=env).stdout.strip().splitlines()[-1])
    if "site-packages" not in info["file"]:
        raise Failure(f"{python} imports lightning from {info['file']}, not from its site-packages")
    return info


def source_lightning(python: Path, cwd: Path, src: Path) -> dict[str, str]:
    """The ``lightning`` a source run imports: from ``src`` on PYTHONPATH, and the venv must have none of its own."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    names = "lightning", "pytorch_lightning", "lightning_fabric"
    installed = run([str(python), "-c", f"import importlib.util as u; print([n for n in {names!r} if u.find_spec(n)])"],
                    cwd=cwd, env=env).stdout.strip()
    if installed != "[]":
        raise Failure(f"{python} has {installed} installed: a source run must import upstream's src/ only"
                      f" (remove that venv, {python.parents[1]})")
    env["PYTHONPATH"] = str(src)
    info = json.loads(run([str(python), "-c", _PROBE], cwd=cwd, env=env).stdout.strip().splitlines()[-1])
    if not Path(info["file"]).resolve().is_relative_to(src.resolve()):
        raise Failure(f"{python} imports lightning from {info['file']}, not from {src}")
    return info


# --- test trees ------------------------------------------------------------------------------------------------------


def resolve(checkout: Path, ref: str, what: str = "--ref (a tag such as 2.6.6, a branch or a commit) that is the"
            " release the fork is built from") -> str:
    commit = git(checkout, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False).stdout.strip()
    if not commit:
        raise Failure(f"{checkout} has no ref {ref!r}; pass {what}")
    return commit


def export_tests(checkout: Path, ref: str, target: Path, paths: tuple[str, ...] = ("tests", "pyproject.toml")) -> str:
    """``paths`` (``tests/`` and ``pyproject.toml``) of ``ref`` into ``target`` (a fresh git repo, so patches apply
    with git)."""
    commit = resolve(checkout, ref)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    missing = [p for p in paths if git(checkout, "cat-file", "-e", f"{commit}:{p}", check=False).returncode != 0]
    if missing:
        raise Failure(f"{ref} ({commit[:10]}) in {checkout} has no {', '.join(missing)}")
    data = subprocess.run(["git", "-C", str(checkout), "archive", "--format=tar", commit, *paths],
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


def apply_test_patches(tree: Path, owned: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Apply upstream/test-patches/ to a test tree; returns patch name -> files it changes. ``owned`` (if given) gets
    the pytest node id of each test function or class a patch changes -> the patch's name."""
    applied = {}
    for patch in read_series(TEST_PATCHES):
        done = git(tree, "apply", "--index", str(patch.path), check=False)
        if done.returncode != 0:
            raise Failure(f"test patch {patch.name} does not apply to upstream's tests:\n{done.stderr.strip()}")
        applied[patch.name] = patch.targets()
        if owned is not None:
            for item in test_files_of(patch.path):
                source = (tree / item.path).read_text(encoding="utf-8")
                for name in changed_tests(source, item.added):
                    owned[f"{item.path[len('tests/') :]}::{name}"] = patch.name
    return applied


def owner(test_id: str, owned: dict[str, str]) -> str:
    """The test patch that changes this test (``""`` if none does)."""
    return next((name for node, name in owned.items() if _is_node(test_id, node)), "")


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
    reused: bool = False  # outcomes read from an earlier run's junit XML
    source: bool = False  # lightning from the tree's src/ on PYTHONPATH (base vs branch), else the venv's install

    def probe(self) -> dict[str, str]:
        tests_dir = self.tree / "tests"
        if self.source:
            return source_lightning(self.python, tests_dir, self.tree / "src")
        return installed_lightning(self.python, tests_dir)


def run_pytest(job: Run, files: list[str], workers: int, timeout: int, extra_args: list[str]) -> None:
    tests_dir = job.tree / "tests"
    job.lightning = job.probe()
    log(f"{job.name}: lightning {job.lightning['lightning']} ({job.lightning['file']}), torch {job.lightning['torch']}")
    cmd = [str(job.python), "-m", "pytest", *files, "-p", "no:cacheprovider", "-p", "no:randomly",
           "--color=no", "-q", "-rN", *([f"--timeout={timeout}"] if timeout > 0 else []), f"--junitxml={job.junit}",
           "-o", "junit_family=xunit1",
           "-o", "console_output_style=classic"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    cmd += extra_args
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "PL_RUN_CUDA_TESTS": "0", "PYTHONDONTWRITEBYTECODE": "1",
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    if job.source:
        env["PYTHONPATH"] = str(job.tree / "src")
    log(f"{job.name}: pytest on {len(files)} files or folders with {workers} worker(s), timeout {timeout}s per test")
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
        if not case.get("classname"):  # a module that failed to collect: its name is the module's
            test_id = f"{case.get('name')}::(collection)"
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


def junit_seconds(path: Path) -> float:
    """The run's wall time as pytest wrote it into the junit XML (for a reused run)."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return float(suite.get("time", 0) or 0) if suite is not None else 0.0


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


def suite_of(test_id: str) -> str:
    """``tests_pytorch`` or ``tests_fabric`` (junit's classname may start with ``tests.``), else ``other``."""
    parts = module_of(test_id).split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    return parts[0] if parts and parts[0] in SUITES else "other"


def by_suite(outcomes: dict[str, str]) -> dict[str, dict[str, int]]:
    groups: dict[str, dict[str, str]] = {}
    for test_id, outcome in outcomes.items():
        groups.setdefault(suite_of(test_id), {})[test_id] = outcome
    return {name: counts(groups[name]) for name in sorted(groups)}


def dotted_modules(files) -> set[str]:
    """Dotted module names (as junit's classname starts) of test files given as ``tests/...py`` paths."""
    out = set()
    for name in files:
        if name.startswith("tests/") and name.endswith(".py"):
            dotted = name[: -len(".py")].replace("/", ".")
            out |= {dotted, dotted[len("tests.") :]}  # junit's classname starts at pytest's rootdir
    return out


def patched_modules(applied: dict[str, list[str]]) -> set[str]:
    """Dotted module names of the test files the test patches change."""
    return dotted_modules(name for files in applied.values() for name in files)


def in_modules(test_id: str, modules: set[str]) -> bool:
    module = module_of(test_id)
    return any(module == m or module.startswith(m + ".") for m in modules)


def compare(before: dict[str, str], after: dict[str, str], patched: set[str],
            owned: dict[str, str] | None = None) -> dict:
    """Per-test outcomes of the reference run (stock, base) against the changed one (fork, branch). With ``owned``
    (test -> test patch), a test that passes before and fails after is the test patch's only if the patch changes that
    test; otherwise, if the patch changes its file."""

    def is_owned(test_id: str) -> bool:
        return bool(owner(test_id, owned)) if owned is not None else in_modules(test_id, patched)

    regressions, patched_regressions, changed, fixed, missing, both = [], [], [], [], [], []
    for test_id, old in sorted(before.items()):
        new = after.get(test_id)
        if new is None:
            (changed if in_modules(test_id, patched) else missing).append(test_id)
        elif old == "passed" and new in FAILED:
            (patched_regressions if is_owned(test_id) else regressions).append(test_id)
        elif old in FAILED and new == "passed":
            fixed.append(test_id)
        elif old in FAILED and new in FAILED:
            both.append(test_id)
    new_ids = sorted(t for t in after if t not in before)
    new_failing = [t for t in new_ids if after[t] in FAILED]
    in_files = [t for t in sorted(set(before) | set(after)) if in_modules(t, patched)]
    patched_tests = [f"{t} (before: {before.get(t, '-')}, after: {after.get(t, '-')})"
                     for t in in_files if before.get(t) != after.get(t)]
    # the keys keep the names of the stock-vs-fork report in both modes
    return {"regressions": regressions, "regressions_in_test_patched_files": patched_regressions,
            "new_failing": new_failing, "fixed_on_fork": fixed, "failing_on_both": both, "absent_on_fork": missing,
            "replaced_by_test_patches": changed, "new_on_fork": new_ids, "in_test_patched_files": patched_tests,
            "same_in_test_patched_files": len(in_files) - len(patched_tests)}


def first_line(message: str) -> str:
    lines = (message or "").strip().splitlines()
    return lines[0][:300] if lines else ""


@dataclass
class Mode:
    """The words of a report: stock vs fork (the installed 2.6.6 and fork) or base vs branch (upstream's src/)."""

    before: str
    after: str
    title: str
    header: list[str]


def table(runs: list[Run], own: set[str]) -> list[str]:
    lines = ["| run | suite | lightning | passed | failed | errors | skipped | xfailed | total | time |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def rows(name: str, job: Run, outcomes: dict[str, str]) -> None:
        suites = by_suite(outcomes)
        for suite, c in [*suites.items(), *([("all", counts(outcomes))] if len(suites) > 1 else [])]:
            took = f"{job.seconds:.0f}s" + (" (reused)" if job.reused else "")
            took = took if suite == "all" or len(suites) == 1 else ""
            lines.append(f"| {name} | {suite} | {job.lightning.get('lightning', '?')} | {c['passed']} | {c['failed']} |"
                         f" {c['error']} | {c['skipped']} | {c['xfailed']} | {c['total']} | {took} |")

    for job in runs:
        upstream = {t: o for t, o in job.outcomes.items() if not in_modules(t, own)}
        rows(job.name, job, upstream)
        ours = {t: o for t, o in job.outcomes.items() if in_modules(t, own)}
        if ours:
            rows(f"{job.name}: our own tests", job, ours)
    return lines


def write_report(workdir: Path, mode: Mode, runs: list[Run], result: dict, applied: dict, summary_extra: dict,
                 own: set[str] = frozenset(), label: str = "") -> str:
    first = runs[0]
    lines = [f"# {mode.title}", "", *mode.header, ""]
    lines += table(runs, own)
    lines.append("")
    needs_gpu = [t for t, o in first.outcomes.items() if o == "skipped" and "GPU" in first.messages.get(t, "")]
    lines.append(f"Skipped here because they need CUDA GPUs (not evidence either way): {len(needs_gpu)} test ids of the"
                 f" {mode.before} run; the rest of the skips need TPUs, MPS, DeepSpeed, standalone (multi-process) runs"
                 " or other extras.")
    lines.append("")
    if applied:
        lines.append(f"Test patches in the {mode.after} run's tree (upstream tests that pin the old behaviour, updated):")
        lines += [f"- {name}: {', '.join(files)}" for name, files in applied.items()]
        lines.append("")
    after = runs[1] if len(runs) > 1 else None
    for note in summary_extra.get("notes", []):
        lines += [f"Note: {note}", ""]
    sections = (
        ("regressions", f"Pass on {mode.before}, fail on the {mode.after}"),
        ("regressions_in_test_patched_files",
         f"Pass on {mode.before}, fail on the {mode.after}, tests a test patch changes (check the patch)"),
        ("failures_on_fork", f"Every test the {mode.after} fails, owned or not"),
        ("new_failing", f"Test ids only on the {mode.after}'s run that fail (added by a test patch)"),
        ("fixed_on_fork", f"Fail on {mode.before}, pass on the {mode.after}"),
        ("failing_on_both", f"Fail on both (not evidence against the {mode.after})"),
        ("in_test_patched_files",
         f"Tests in files a test patch changes, whose outcome differs (the {mode.after} runs the new version)"),
        ("replaced_by_test_patches", f"{mode.before.capitalize()} test ids a test patch replaced (renamed or removed)"),
        ("new_on_fork", f"Test ids only on the {mode.after}'s run (added or renamed by a test patch)"),
        ("absent_on_fork", f"{mode.before.capitalize()} test ids the {mode.after}'s run did not report"),
    )
    for key, title in sections:
        items = result.get(key, [])
        lines.append(f"## {title}: {len(items)}")
        lines.append("")
        for test_id in items:
            note = ""
            if after is not None and key in ("regressions", "regressions_in_test_patched_files", "new_failing"):
                message = first_line(after.messages.get(test_id, ""))
                note = f"  \n  `{message}`" if message else ""
            lines.append(f"- {test_id}{note}")
        if key == "in_test_patched_files":
            lines.append(f"- and {result.get('same_in_test_patched_files', 0)} test ids in those files with the same"
                         " outcome on both")
        lines.append("")
    own_result = summary_extra.get("own_tests")
    if own_result is not None:
        lines.append(f"## Our own tests on the {mode.after} (files it adds under tests/), failing:"
                     f" {len(own_result['failing'])}")
        lines.append("")
        lines.append(f"{format_counts(own_result['counts'])}, in {len(own_result['files'])} files.")
        lines.append("")
        for test_id in own_result["failing"]:
            message = first_line(after.messages.get(test_id, "")) if after is not None else ""
            lines.append(f"- {test_id}" + (f"  \n  `{message}`" if message else ""))
        lines.append("")
    text = "\n".join(lines)
    summary = {**{k: v for k, v in summary_extra.items() if k != "notes"}, "notes": summary_extra.get("notes", []),
               "runs": {j.name: {"counts": counts({t: o for t, o in j.outcomes.items() if not in_modules(t, own)}),
                                 "suites": by_suite({t: o for t, o in j.outcomes.items() if not in_modules(t, own)}),
                                 "lightning": j.lightning, "seconds": round(j.seconds), "returncode": j.returncode}
                        for j in runs},
               "test_patches": applied, **result}
    for name in ("report", f"report-{label}") if label else ("report",):
        (workdir / f"{name}.md").write_text(text, encoding="utf-8")
    for name in ("summary", f"summary-{label}") if label else ("summary",):
        (workdir / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return text


def failed_overall(result: dict, summary_extra: dict) -> bool:
    own = summary_extra.get("own_tests") or {}
    return bool(result["regressions"] or result["regressions_in_test_patched_files"] or result["new_failing"]
                or own.get("failing"))


# --- the two modes ---------------------------------------------------------------------------------------------------


def run_all(runs: list[Run], files: dict[str, list[str]], keys: dict[str, str], args, reuse: str) -> None:
    """Run each job's files (``files[job.name]``); ``--reuse-stock`` reuses the reference run's junit when its key
    (``keys[job.name]``: upstream commit, pins; and the selection) is unchanged."""
    extra = args.pytest_args.split()
    for job in runs:
        if args.report_only:
            if not job.junit.is_file():
                raise Failure(f"--report-only: {job.junit} does not exist (run without --report-only first)")
            job.outcomes, job.messages = read_junit(job.junit)
            job.seconds, job.reused = junit_seconds(job.junit), True
            job.lightning = job.probe()
            log(f"{job.name}: read {job.junit} ({format_counts(counts(job.outcomes))})")
            continue
        stamp = job.junit.with_suffix(".key")
        job_key = hashlib.sha256(f"{keys[job.name]} {files[job.name]} {extra}".encode()).hexdigest()
        if job.name == reuse and args.reuse_stock and job.junit.is_file() and stamp.is_file() \
                and stamp.read_text().strip() == job_key:
            job.outcomes, job.messages = read_junit(job.junit)
            job.seconds, job.reused = junit_seconds(job.junit), True
            job.lightning = job.probe()
            log(f"{job.name}: reusing {job.junit} ({format_counts(counts(job.outcomes))})")
            continue
        stamp.unlink(missing_ok=True)
        run_pytest(job, files[job.name], args.workers, args.timeout, extra)
        stamp.write_text(job_key + "\n")


def selection(tests_dir: Path, args, workdir: Path, name: str = "selected") -> list[str]:
    if args.full:
        files = [suite for suite in SUITES if (tests_dir / suite).is_dir()]
    else:
        files = select_tests(tests_dir, args.tests)
    (workdir / f"{name}.txt").write_text("\n".join(files) + "\n", encoding="utf-8")
    log(f"{len(files)} test {'suites' if args.full else 'files'} selected (list in {workdir / f'{name}.txt'})")
    return files


def stock_vs_fork(args, checkout: Path, workdir: Path) -> int:
    which = [args.only] if args.only else ["stock", "fork"]
    given = {"stock": args.stock_python, "fork": args.fork_python}
    pythons = setup_venvs(args.venvs.resolve(), REPO, [name for name in which if given[name] is None])
    pythons.update({name: given[name].absolute() for name in which if given[name] is not None})
    trees = {name: workdir / f"{name}-tree" for name in which}
    commit = ""
    for name, tree in trees.items():
        commit = export_tests(checkout, args.ref, tree)
    applied = {}
    owned: dict[str, str] = {}
    if "fork" in trees and not args.no_test_patches:
        applied = apply_test_patches(trees["fork"], owned)
    files = selection(trees.get("stock", next(iter(trees.values()))) / "tests", args, workdir)
    runs = [Run(name, pythons[name], trees[name], workdir / f"{name}.xml") for name in which]
    run_all(runs, {job.name: files for job in runs}, {job.name: f"{commit} {REQUIREMENTS.read_text()}" for job in runs},
            args, "stock")
    if len(runs) == 1:
        print(format_counts(counts(runs[0].outcomes)))
        for suite, c in by_suite(runs[0].outcomes).items():
            print(f"  {suite}: {format_counts(c)}")
        return 0
    mode = Mode("stock", "fork", "Upstream tests: stock lightning 2.6.6 vs the fork",
                [f"Upstream tests at `{args.ref}` ({commit[:10]}), {len(runs[0].outcomes)} test ids collected on stock"
                 f" ({'the full CPU suites' if args.full else 'the touched areas'})."])
    result = compare(runs[0].outcomes, runs[1].outcomes, patched_modules(applied), owned)
    # every test the fork fails: owned by a test patch (it changes that test on purpose), failing on stock too, or not
    result["failures_on_fork"] = [
        f"{t}: " + (f"owned by {owner(t, owned)}" if owner(t, owned) else
                    "fails on stock too" if runs[0].outcomes.get(t) in FAILED else "NOT OWNED by any test patch")
        for t, o in sorted(runs[1].outcomes.items()) if o in FAILED]
    extra = {"mode": "stock-vs-fork", "ref": args.ref, "commit": commit, "full": args.full,
             "owned_tests": owned}
    print(write_report(workdir, mode, runs, result, applied, extra))
    return 1 if failed_overall(result, extra) else 0


def branch_changes(checkout: Path, base: str, branch: str) -> tuple[list[str], list[str]]:
    """The files under tests/ that the branch adds and those it modifies (or deletes), against the base commit."""
    listed = git(checkout, "diff", "--name-status", "--no-renames", base, branch, "--", "tests").stdout
    added, modified = [], []
    for line in filter(None, listed.splitlines()):
        status, _, path = line.partition("\t")
        (added if status == "A" else modified).append(path)
    return added, modified


def base_vs_branch(args, checkout: Path, workdir: Path) -> int:
    """``--branch`` against its merge base with ``--base``; without ``--branch`` (``--only base``), ``--base`` alone."""
    tip = resolve(checkout, args.base, "--base, the upstream branch the pull request goes to (master)")
    if args.branch:
        branch = resolve(checkout, args.branch, "--branch, a stack branch that `make pr-stack` built in that clone")
        base = git(checkout, "merge-base", tip, branch).stdout.strip()
    else:
        branch = base = tip
    notes = []
    if base != tip:
        notes.append(f"{args.branch} starts from {base[:10]}, not from {args.base}'s tip {tip[:10]}: the base run tests"
                     " that merge base (build the stack again with `make pr-stack` to test the tip)")
        log(f"note: {notes[-1]}")
    which = [args.only] if args.only else ["base", "branch"]
    python = ensure_venv(args.venvs.resolve() / "source", ["-r", str(SOURCE_REQUIREMENTS)],
                         "source v1 " + SOURCE_REQUIREMENTS.read_text(encoding="utf-8"))
    commits = {"base": base, "branch": branch}
    trees = {name: workdir / f"{name}-tree" for name in which}
    for name, tree in trees.items():
        export_tests(checkout, commits[name], tree, SOURCE_PATHS)

    # what the branch adds or changes under tests/ is the PR's own tests: run on the branch, reported apart
    added, modified = branch_changes(checkout, base, branch)
    own_files = sorted(added + modified)
    applied: dict[str, list[str]] = {}
    for note in notes[1 if base != tip else 0 :]:
        log(f"note: {note}")
    own = dotted_modules(own_files)

    files = selection(trees.get("base", next(iter(trees.values()))) / "tests", args, workdir)
    own_tests = [name[len("tests/") :] for name in added
                 if Path(name).name.startswith("test_") and name.endswith(".py")
                 and name.split("/")[1:2] and name.split("/")[1] in SUITES]
    per_run = {"base": files, "branch": files if args.full else sorted(set(files) | set(own_tests))}
    runs = [Run(name, python, trees[name], workdir / f"{name}.xml", source=True) for name in which]
    pins = f"{REQUIREMENTS.read_text()} {SOURCE_REQUIREMENTS.read_text()} {TORCH}"
    run_all(runs, {job.name: per_run[job.name] for job in runs},
            {job.name: f"{commits[job.name]} {pins}" for job in runs}, args, "base")
    if len(runs) == 1:
        job = runs[0]
        upstream = {t: o for t, o in job.outcomes.items() if not in_modules(t, own)}
        print(format_counts(counts(upstream)))
        for suite, c in by_suite(upstream).items():
            print(f"  {suite}: {format_counts(c)}")
        ours = {t: o for t, o in job.outcomes.items() if in_modules(t, own)}
        if ours:
            print(f"  our own tests: {format_counts(counts(ours))}")
        return 0
    base_run, branch_run = runs
    upstream_after = {t: o for t, o in branch_run.outcomes.items() if not in_modules(t, own)}
    result = compare(base_run.outcomes, upstream_after, set())
    ours = {t: o for t, o in branch_run.outcomes.items() if in_modules(t, own)}
    what = "the full CPU suites" if args.full else "the touched areas"
    mode = Mode("base", "branch", f"Upstream tests: {args.base} vs the pull-request branch {args.branch}",
                [f"Base: `{args.base}` at the branch's merge base {base[:10]}; branch: `{args.branch}` ({branch[:10]});"
                 f" {what}; each run imports lightning from its own tree's `src/` (PYTHONPATH), torch"
                 f" {base_run.lightning.get('torch', '?')}.",
                 "",
                 f"{len(base_run.outcomes)} test ids collected on base. The branch's own test files (added or changed"
                 f" under tests/, {len(own_files)} files) are counted apart and left out of the comparison."])
    extra = {"mode": "base-vs-branch", "ref": args.base, "commit": base, "base": args.base, "base_commit": base, "base_tip": tip, "branch": args.branch,
             "branch_commit": branch, "full": args.full, "notes": notes,
             "own_tests": {"files": own_files, "counts": counts(ours), "suites": by_suite(ours),
                           "failing": sorted(t for t, o in ours.items() if o in FAILED)}}
    print(write_report(workdir, mode, runs, result, applied, extra, own, "full" if args.full else "touched"))
    return 1 if failed_overall(result, extra) else 0


# --- each stack PR's tests on the fork --------------------------------------------------------------------------------

STACK = HERE / "stack"
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@")


@dataclass
class StackTestFile:
    path: str  # tests/...py
    base_blob: str  # master's blob id ("" for a new file)
    added: list[int]  # line numbers (in the PR's version) of the lines the PR adds


def stack_prs(stack: Path = STACK) -> list[tuple[str, Path]]:
    """(folder name, changes.patch) of each stack PR, in merge order (``merge_order`` of its pr.toml)."""
    import tomllib

    prs = []
    for folder in sorted(p for p in stack.iterdir() if (p / "pr.toml").is_file()):
        order = tomllib.loads((folder / "pr.toml").read_text(encoding="utf-8")).get("merge_order", 0)
        prs.append((order, folder.name, folder / "changes.patch"))
    return [(name, patch) for _, name, patch in sorted(prs)]


def test_files_of(patch: Path) -> list[StackTestFile]:
    """The ``tests/**/test_*.py`` files a PR's patch adds or changes, with the lines it adds."""
    files: list[StackTestFile] = []
    current = None
    line = 0
    for text in patch.read_text(encoding="utf-8").splitlines():
        if text.startswith("diff --git "):
            path = text.split(" b/", 1)[-1]
            current = None
            if path.startswith("tests/") and Path(path).name.startswith("test_") and path.endswith(".py"):
                current = StackTestFile(path, "", [])
                files.append(current)
        elif current is None:
            continue
        elif text.startswith("index "):
            blob = text.split()[1].split("..")[0]
            current.base_blob = "" if set(blob) == {"0"} else blob
        elif match := _HUNK.match(text):
            line = int(match.group(1))
        elif text.startswith("+") and not text.startswith("+++"):
            current.added.append(line)
            line += 1
        elif text.startswith(" "):
            line += 1
    return files


def changed_tests(source: str, added: list[int]) -> list[str]:
    """The test functions and classes (top level) that hold an added line: pytest node names."""
    import ast

    names = []
    for node in ast.parse(source).body:
        is_test = (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")) or (
            isinstance(node, ast.ClassDef) and node.name.startswith("Test"))
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        if is_test and any(first <= n <= (node.end_lineno or node.lineno) for n in added):
            names.append(node.name)
    return names


def merge_pr_tests(checkout: Path, tree: Path, patch: Path) -> tuple[list[str], list[str]]:
    """Merge the PR's test files into ``tree`` (3-way against master's version); returns its pytest node ids (relative
    to ``tests/``) and the files whose merge conflicted (both sides kept there, the PR's last: its definitions win)."""
    nodes, conflicted = [], []
    for item in test_files_of(patch):
        with tempfile.TemporaryDirectory(prefix="stack-test-") as tmp:
            scratch = Path(tmp)
            base = b""
            if item.base_blob:
                got = subprocess.run(["git", "-C", str(checkout), "cat-file", "blob", item.base_blob],
                                     capture_output=True)
                if got.returncode != 0:
                    raise Failure(f"{patch.parent.name}: {checkout} lacks master's {item.path} ({item.base_blob});"
                                  " fetch upstream master into the clone")
                base = got.stdout
            (scratch / item.path).parent.mkdir(parents=True, exist_ok=True)
            if item.base_blob:
                (scratch / item.path).write_bytes(base)
            done = subprocess.run(["git", "apply", f"--include={item.path}", str(patch)], cwd=scratch,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise Failure(f"{patch.parent.name}: its patch does not apply to master's {item.path}:\n{done.stderr}")
            theirs = (scratch / item.path).read_bytes()
            target = tree / item.path
            ours = target.read_bytes() if target.is_file() else None
            if ours is None or ours == base:
                merged = theirs
            else:
                for name, data in (("ours", ours), ("base", base), ("theirs", theirs)):
                    (scratch / name).write_bytes(data)
                merge = subprocess.run(["git", "merge-file", "-p", "ours", "base", "theirs"], cwd=scratch,
                                       capture_output=True)
                if merge.returncode != 0:
                    conflicted.append(item.path)
                    merge = subprocess.run(["git", "merge-file", "-p", "--union", "ours", "base", "theirs"],
                                           cwd=scratch, capture_output=True)
                merged = merge.stdout
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(merged)
            relative = item.path[len("tests/") :]
            if item.base_blob:
                nodes += [f"{relative}::{name}" for name in changed_tests(theirs.decode(), item.added)]
            else:
                nodes.append(relative)
    return nodes, conflicted


def stack_on_fork(args, checkout: Path, workdir: Path) -> int:
    """Each stack PR's tests, merged in merge order into the fork's test tree, run against the installed fork."""
    python = args.fork_python.absolute() if args.fork_python else \
        setup_venvs(args.venvs.resolve(), REPO, ["fork"])["fork"]
    tree = workdir / "fork-tree"
    commit = export_tests(checkout, args.ref, tree)
    applied = apply_test_patches(tree)
    per_pr = {}
    for name, patch in stack_prs():
        nodes, conflicted = merge_pr_tests(checkout, tree, patch)
        per_pr[name] = {"nodes": nodes, "conflicted": conflicted}
        log(f"{name}: {len(nodes)} test nodes" + (f"; both sides kept in {conflicted}" if conflicted else ""))
    files = sorted({node for pr in per_pr.values() for node in pr["nodes"]})
    job = Run("fork", python, tree, workdir / "stack.xml")
    run_pytest(job, files, args.workers, args.timeout, args.pytest_args.split())
    lines = [f"# Each stack PR's tests on the fork (upstream's tests at `{args.ref}`, {commit[:10]}, with the test"
             " patches)", "", f"lightning {job.lightning.get('lightning')} ({job.lightning.get('file')}), torch"
             f" {job.lightning.get('torch')}; {len(applied)} test patches applied.", "",
             "| PR (merge order) | test nodes | passed | failed | skipped | merged with conflicts (both sides kept) |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    failing = []
    for name, pr in per_pr.items():
        mine = {t: o for t, o in job.outcomes.items() if any(_is_node(t, node) for node in pr["nodes"])}
        c = counts(mine)
        lines.append(f"| {name} | {len(pr['nodes'])} | {c['passed']} | {c['failed'] + c['error']} | {c['skipped']} |"
                     f" {', '.join(pr['conflicted']) or '-'} |")
        failing += [f"{name}: {t}  `{first_line(job.messages.get(t, ''))}`" for t, o in mine.items() if o in FAILED]
    lines += ["", f"## Failing on the fork: {len(failing)}", "", *[f"- {item}" for item in failing], ""]
    text = "\n".join(lines)
    (workdir / "report.md").write_text(text, encoding="utf-8")
    (workdir / "summary.json").write_text(json.dumps({"ref": args.ref, "commit": commit, "prs": per_pr,
                                                      "counts": counts(job.outcomes), "failing": failing},
                                                     indent=2) + "\n", encoding="utf-8")
    print(text)
    return 1 if failing or not job.outcomes else 0


def _is_node(test_id: str, node: str) -> bool:
    """Whether a junit test id (``tests_pytorch.x.test_y::test_z[param]``) belongs to a pytest node id."""
    path, _, name = node.partition("::")
    module = path[: -len(".py")].replace("/", ".")
    test_module, _, test_name = test_id.partition("::")
    if name and (test_module == f"{module}.{name}" or test_module.endswith(f".{module}.{name}")):
        return True  # a method of a test class: junit's classname ends with the class
    if not (test_module == module or test_module.endswith("." + module)):
        return False
    return not name or test_name.split("[")[0] == name or test_name == "(collection)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, type=Path, help="an upstream Lightning git checkout")
    parser.add_argument("--ref", default="2.6.5", help="the upstream revision whose tests run (default: 2.6.5, the last"
                                                       " release tag in upstream's repository; 2.6.6 has none)")
    parser.add_argument("--branch", help="base vs branch: a stack branch in --upstream (from `make pr-stack`),"
                                         " tested from source against its merge base with --base")
    parser.add_argument("--fork-python", type=Path,
                        help="a Python whose installed lightning is the fork (no fork venv is built)")
    parser.add_argument("--stock-python", type=Path,
                        help="a Python whose installed lightning is stock 2.6.6 (no stock venv is built)")
    parser.add_argument("--stack", action="store_true",
                        help="each stack PR's tests (upstream/stack/*/changes.patch) against the installed fork")
    parser.add_argument("--base", default="master", help="with --branch: the branch the PR goes to (default master)")
    parser.add_argument("--full", action="store_true",
                        help="run the whole CPU suites tests_pytorch and tests_fabric, not the touched areas")
    parser.add_argument("--venvs", type=Path, default=HERE / ".venvs", help="where the venvs live")
    parser.add_argument("--workdir", type=Path, help="test trees, junit XML, report (default: upstream/results/,"
                                                     " results/branch/ with --branch; -full with --full)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (1: no xdist)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (0: no limit, no pytest-timeout)")
    parser.add_argument("--only", choices=["stock", "fork", "base", "branch"], help="run one side only (no comparison)")
    parser.add_argument("--no-test-patches", action="store_true", help="run the fork on upstream's tests as they are")
    parser.add_argument("--reuse-stock", "--reuse-base", action="store_true", dest="reuse_stock",
                        help="reuse the last stock (base) run's results (same upstream commit, selection and pins)")
    parser.add_argument("--report-only", action="store_true",
                        help="run no test: write the report again from the last runs' junit XML in --workdir")
    parser.add_argument("--tests", nargs="*", default=[], help="extra test files or folders (relative to tests/)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    args = parser.parse_args(argv)

    checkout = args.upstream.expanduser().resolve()
    if args.only == "branch" and not args.branch:
        parser.error("--only branch needs --branch")
    if args.branch and args.only in ("stock", "fork"):
        parser.error(f"--only {args.only} is for stock vs fork (no --branch): choose base or branch")
    if args.stack and (args.branch or args.only or args.full):
        parser.error("--stack runs the stack PRs' tests on the fork: no --branch, --only or --full")
    if args.workdir is None:
        source = args.branch or args.only == "base"
        args.workdir = HERE / "results" / ("branch" if source else "stack" if args.stack else "")
        if args.full:
            args.workdir = args.workdir.with_name(args.workdir.name + "-full") if source else args.workdir / "full"
    workdir = args.workdir.resolve()
    try:
        if git(checkout, "rev-parse", "--git-dir", check=False).returncode != 0:
            raise Failure(f"{checkout} is not a git repository of upstream Lightning (a clone, or a bare mirror)")
        workdir.mkdir(parents=True, exist_ok=True)
        source = args.branch or args.only == "base"
        if args.stack:
            return stack_on_fork(args, checkout, workdir)
        return base_vs_branch(args, checkout, workdir) if source else stock_vs_fork(args, checkout, workdir)
    except Failure as err:
        print(f"upstream_test: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
