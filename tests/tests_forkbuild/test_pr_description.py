"""tools/upstream/pr_description.py (``make pr-description``): the upstream PR's description from the patch headers.

Each test writes a tiny series (two or three patches with DEP-3 headers) to a temporary folder and runs the script on
it as ``make pr-description`` does, in a subprocess; no network, no build.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "upstream" / "pr_description.py"
ISSUES = "https://github.com/Lightning-AI/pytorch-lightning/issues"
DIFF = "diff --git a/src/x.py b/src/x.py\n--- a/src/x.py\n+++ b/src/x.py\n@@ -1 +1 @@\n-a\n+b\n"

HOOKS = f"""\
Description: Give plugins iteration hooks.
 The scaler must update once per iteration.
 .
 Second paragraph of the why.
Bug: {ISSUES}/101, {ISSUES}/102
 {ISSUES}/103
Adds: src/lightning/pytorch/new_module.py
 tests/tests_pytorch/test_new_module.py
Notice:
 - One scaler update per iteration.
 - Clipping sees unscaled gradients.
Split: 1: training-iteration hooks
Forwarded: not yet
Author: lightning-amp fork
"""
WRAPPERS = f"""\
Description: Track optimizer wrappers.
 So that unscale_ recognises them.
Bug: {ISSUES}/102 https://github.com/Lightning-AI/pytorch-lightning/pull/7
Split: 1: training-iteration hooks
Forwarded: not yet
"""
MONITOR = f"""\
Description: Add the LossScaleMonitor callback.
 It logs the loss scale.
Bug: #103
Notice: A new callback logs the loss scale
 and the skipped steps.
Adds: tests/tests_pytorch/callbacks/test_monitor.py
Split: 2: the callback
Forwarded: not yet
"""
CHANGELOG = f"""\
# Changelog

## [Unreleased] - 2.6.6+amp.1

### Added

- Iteration hooks (0001)

### Changed

- `GradScaler.update()` runs once per training batch
  instead of after every step (0001)
- Wrappers are tracked ([#102]({ISSUES}/102), 0002)

### Fork packaging (not forwarded upstream)

- not upstream's business

## [2.6.6]
"""


def _series(folder: Path, *headers: str) -> Path:
    folder.mkdir(parents=True)
    names = []
    for n, header in enumerate(headers, 1):
        name = f"{n:04d}-patch-{n}.patch"
        (folder / name).write_text(header + DIFF, encoding="utf-8")
        names.append(name)
    (folder / "series").write_text("# the order\n" + "\n".join(names) + "\n", encoding="utf-8")
    return folder


def _run(tmp_path: Path, patches: Path, results: Path, changelog: Path | None = None) -> str:
    (tmp_path / "no-test-patches").mkdir(exist_ok=True)
    command = [sys.executable, str(SCRIPT), "--patches", str(patches), "--results", str(results),
               "--changelog", str(changelog or tmp_path / "absent.md"),
               "--test-patches", str(tmp_path / "no-test-patches")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (results / "PR.md").read_text(encoding="utf-8") == done.stdout
    return done.stdout


def _section(text: str, heading: str) -> str:
    """From ``heading`` to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    start = text.index(heading + "\n")
    ends = [text.find(f"\n{'#' * n} ", start + len(heading)) for n in range(1, len(level) + 1)]
    ends = [e for e in ends if e != -1]
    return text[start : min(ends) if ends else len(text)]


def test_new_headers_closes_adds_split_notice_and_placeholder(tmp_path: Path) -> None:
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text(CHANGELOG, encoding="utf-8")
    text = _run(tmp_path, _series(tmp_path / "patches", HOOKS, WRAPPERS, MONITOR), tmp_path / "results", changelog)

    hooks = _section(text, "### 0001. Give plugins iteration hooks.")
    assert "The scaler must update once per iteration.\n\nSecond paragraph of the why." in hooks
    assert "Closes #101, closes #102, closes #103" in hooks
    assert "Adds: `src/lightning/pytorch/new_module.py`, `tests/tests_pytorch/test_new_module.py`" in hooks
    wrappers = _section(text, "### 0002. Track optimizer wrappers.")
    assert "Closes #102" in wrappers and "See #7" in wrappers and "Adds:" not in wrappers
    assert "Closes #103  \nAdds:" in _section(text, "### 0003. Add the LossScaleMonitor callback.")
    assert "Closes #101, closes #102, closes #103\n" in _section(text, "## What does this PR do?")

    notice = _section(text, "## Behaviour changes a user will notice")
    assert "- One scaler update per iteration. (0001)\n- Clipping sees unscaled gradients. (0001)\n" in notice
    assert "- A new callback logs the loss scale and the skipped steps. (0003)" in notice
    # the CHANGELOG's Changed entries, folded away, without our patch numbers; no other section
    assert "- `GradScaler.update()` runs once per training batch instead of after every step\n" in notice
    assert f"- Wrappers are tracked ([#102]({ISSUES}/102))\n" in notice
    assert "Iteration hooks" not in notice and "business" not in notice

    evidence = _section(text, "## Test evidence")
    assert "**TODO:** no test results yet: `make upstream-test UPSTREAM=<upstream clone>`" in evidence
    tests = _section(text, "### The new tests")
    listed = ("- `tests/tests_pytorch/test_new_module.py` (0001)\n"
              "- `tests/tests_pytorch/callbacks/test_monitor.py` (0003)\n")
    assert listed in tests and "src/lightning" not in tests

    split = _section(text, "## Proposed split for review")
    first, second = _section(split, "### PR 1: training-iteration hooks"), _section(split, "### PR 2: the callback")
    assert "- 0001. Give plugins iteration hooks.\n- 0002. Track optimizer wrappers.\n" in first
    # an issue that a later PR also names closes with that one
    assert "- Depends on: nothing" in first and "- Closes #101, closes #102\n- Part of #103 (closed by PR 2)\n" in first
    assert "- 0003. Add the LossScaleMonitor callback.\n- Depends on: PR 1\n- Closes #103\n" in second
    assert "### PR 3" not in split

    issues = _section(text, "## Upstream issues")
    assert "- #101 (0001)\n- #102 (0001, 0002)\n- #103 (0001, 0003)\n" in issues and "#7 (0002)" in issues


def test_todays_headers_one_pr_per_patch_and_results(tmp_path: Path) -> None:
    """No Adds/Notice/Split (the headers before issue 14); upstream-test's results, with keys it may add later."""
    old = ["\n".join(ln for ln in h.splitlines() if not ln.startswith(("Adds", "Notice", "Split", " tests/", " -")))
           + "\n" for h in (HOOKS, WRAPPERS)]
    results = tmp_path / "results"
    results.mkdir()
    counts = {"passed": 10, "failed": 1, "error": 0, "skipped": 3, "xfailed": 0, "total": 14}
    (results / "summary.json").write_text(json.dumps({
        "ref": "2.6.6", "commit": "abcdef0123456789",
        "runs": {"stock": {"counts": counts, "lightning": {"torch": "2.13.0+cpu"}},
                 "fork": {"counts": {**counts, "passed": 11, "failed": 0}, "lightning": {"torch": "2.13.0+cpu"},
                          "suites": {"tests_fabric": {"passed": 4, "total": 4}}}},
        "regressions": [], "fixed_on_fork": ["tests_pytorch/a.py::test_a"], "a_key_from_later": {"x": 1},
    }), encoding="utf-8")
    (results / "report.md").write_text("# Upstream tests\n\n## Pass on stock, fail on the fork: 0\n", encoding="utf-8")
    text = _run(tmp_path, _series(tmp_path / "patches", *old), results)

    assert "Closes #101, closes #102, closes #103" in _section(text, "### 0001. Give plugins iteration hooks.")
    assert "Adds: `" not in text
    split = _section(text, "## Proposed split for review")
    assert "No commit has a `Split:` header, so this proposes one PR per commit" in split
    assert "### PR 1: Give plugins iteration hooks." in split and "### PR 2: Track optimizer wrappers." in split
    assert "- Depends on: PR 1" in _section(split, "### PR 2: Track optimizer wrappers.")
    assert "**TODO:** no commit has a `Notice:` header" in text  # and no CHANGELOG here

    evidence = _section(text, "### Upstream's tests of the touched areas, stock 2.6.6 against this branch")
    assert "no test results yet" not in evidence
    assert "`2.6.6` (abcdef0123), on CPU, torch 2.13.0+cpu" in evidence
    assert "| stock | 10 | 1 | 0 | 3 | 0 | 14 |" in evidence and "| fork | 11 | 0 | 0 | 3 | 0 | 14 |" in evidence
    assert "| fork / suites / tests_fabric | 4 |  |  |  |  | 4 |" in evidence
    assert "- Pass on stock, fail on this branch: 0\n- Fail on stock, pass on this branch: 1\n" in evidence
    assert "#### Upstream tests\n\n##### Pass on stock, fail on the fork: 0" in evidence  # report.md, folded away
    assert "**TODO:** name the test files in the patches' `Adds:` headers" in text


def test_the_repositorys_series(tmp_path: Path) -> None:
    """The real headers: every patch is a commit of the description, in series order, but for those marked
    `Forwarded: not-needed`, which are not for upstream (make pr leaves them out too)."""
    results = tmp_path / "results"
    done = subprocess.run([sys.executable, str(SCRIPT), "--results", str(results)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    names = [ln.strip() for ln in (REPO / "patches" / "series").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    not_needed = [n for n in names if "\nForwarded: not-needed" in (REPO / "patches" / n).read_text()]
    assert not_needed and all(f"\n### {name[:4]}. " not in done.stdout for name in not_needed)
    at = [done.stdout.index(f"\n### {name[:4]}. ") for name in names if name not in not_needed]
    assert at == sorted(at) and "## Proposed split for review" in done.stdout and "Closes #" in done.stdout
    # the documentation commits: our pages and every docs patch, by the first line of its Description
    docs = done.stdout[done.stdout.index("## Documentation") :]
    assert "docs/source-pytorch/model/manual_optimization_mixed_precision.rst" in docs
    for name in (REPO / "docs" / "patches" / "series").read_text().splitlines():
        if name.strip() and not name.startswith("#"):
            assert f"- `{name.strip()[: -len('.patch')]}`: " in docs
