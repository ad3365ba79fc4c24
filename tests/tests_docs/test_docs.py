"""The fork's documentation builds with Sphinx without a single warning, and every example on its pages runs.

The pages are ``docs/source-pytorch/model/manual_optimization_mixed_precision.rst`` (a section that upstream's manual
optimization page includes, through ``docs/patches/0001``) and ``docs/source-pytorch/common/precision_mixed.rst``. They
are built as the Sphinx project ``docs/fork`` (see its ``conf.py``):

* ``-b html`` with ``-W --keep-going -n``: no warning, every cross-reference resolved;
* ``-b doctest``: every ``testcode`` block is executed against the fork's ``lightning`` and its ``testoutput`` compared,
  and the number of executed examples per page is exactly :data:`EXPECTED_EXAMPLES` (a block that stops being executed,
  or a new one nobody counted, fails the test);

and, without Sphinx, the pages hold no Python code that would escape the doctest build, and the docs patches are
well-formed and point at files that exist.

The two builds run in parallel, once per session; together they take about 15-25 s on two cores, most of it importing
torch and Lightning. Sphinx comes from ``requirements/docs.txt``. Without it the two builds are skipped, unless
``requirements/test.txt`` pulls in ``docs.txt`` or ``CI`` is set: then a missing Sphinx fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests_fabric.helpers.torch_features import CPU_16_MIXED, requires_cpu_16_mixed

REPO = Path(__file__).resolve().parents[2]
PAGES = REPO / "docs" / "source-pytorch"  # the pages, in upstream's layout
PROJECT = REPO / "docs" / "fork"  # the fork's Sphinx project: conf.py, index, links to the pages
DOCS_PATCHES = REPO / "docs" / "patches"

#: ``testcode`` blocks per page, every one executed by the doctest build
EXPECTED_EXAMPLES = {
    "model/manual_optimization_mixed_precision.rst": 16,
    "common/precision_mixed.rst": 7,
}
#: the Sphinx document each page's examples run in: the section runs inside the page that includes it
DOCUMENT_OF_PAGE = {
    "model/manual_optimization_mixed_precision.rst": "model/manual_optimization",
    "common/precision_mixed.rst": "common/precision_mixed",
}
#: the section that upstream's ``model/manual_optimization.rst`` includes, and the line that includes it
SECTION = "model/manual_optimization_mixed_precision.rst"
INCLUDE_LINE = ".. include:: /model/manual_optimization_mixed_precision.rst"

BUILD_TIMEOUT_S = 600


# ------------------------------------------------------------------------------------------------------------------
# the two Sphinx builds
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Build:
    builder: str
    outdir: Path
    returncode: int
    log: str
    seconds: float


def _sphinx_is_required() -> bool:
    """Under CI, or once the test requirements pull in the docs requirements, a missing Sphinx is an error."""
    test_requirements = (REPO / "requirements" / "test.txt").read_text(encoding="utf-8")
    pulls_docs = re.search(r"^\s*-r\s+(requirements/)?docs\.txt\s*$", test_requirements, re.MULTILINE)
    return bool(os.environ.get("CI")) or pulls_docs is not None


def _require_sphinx() -> None:
    try:
        import sphinx  # noqa: F401
    except ImportError:
        message = "Sphinx is not installed: `pip install -r requirements/docs.txt`"
        if _sphinx_is_required():
            pytest.fail(f"{message}; the docs examples must run wherever the tests run")
        pytest.skip(message)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Build]:
    """``-b html`` and ``-b doctest`` of ``docs/fork``, run side by side in fresh folders."""
    _require_sphinx()
    root = tmp_path_factory.mktemp("docs")
    running = {}
    for builder in ("html", "doctest"):
        outdir = root / builder
        command = [
            sys.executable, "-m", "sphinx",
            "-W", "--keep-going", "-n", "-E",
            "-b", builder,
            "-d", str(root / f"doctrees-{builder}"),
            str(PROJECT), str(outdir),
        ]  # fmt: skip
        process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ)
        )
        running[builder] = (process, outdir, time.perf_counter())
    done = {}
    for builder, (process, outdir, started) in running.items():
        try:
            log, _ = process.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            log, _ = process.communicate()
            log += f"\n[killed after {BUILD_TIMEOUT_S} s]"
        done[builder] = Build(builder, outdir, process.returncode, log, time.perf_counter() - started)
    return done


def _assert_succeeded(build: Build) -> None:
    assert build.returncode == 0, f"sphinx-build -b {build.builder} failed ({build.returncode}):\n{build.log[-8000:]}"


def test_pages_build_without_warnings(builds: dict[str, Build]) -> None:
    build = builds["html"]
    _assert_succeeded(build)
    assert "WARNING" not in build.log, build.log
    manual = (build.outdir / "model" / "manual_optimization.html").read_text(encoding="utf-8")
    precision = (build.outdir / "common" / "precision_mixed.html").read_text(encoding="utf-8")
    # the section is rendered inside the page that includes it, under the page's title
    assert "Manual Optimization" in manual
    assert "Mixed Precision" in manual
    assert "Testing fp16 on a CPU" in manual
    # the cross-references between the two pages resolved to links
    assert "precision_mixed.html" in manual
    assert "manual_optimization.html#mixed-precision" in precision


def _doctest_results(output: str) -> dict[str, tuple[int, int]]:
    """``{document: (passed, failed)}`` from the doctest builder's ``output.txt``."""
    results = {}
    for block in output.split("\nDocument: ")[1:]:
        document = block.split("\n", 1)[0].strip()
        match = re.search(r"^(\d+) passed and (\d+) failed\.$", block, re.MULTILINE)
        assert match, f"no result for document {document}:\n{block}"
        results[document] = (int(match.group(1)), int(match.group(2)))
    return results


#: how an example fails on a torch that lacks a feature it shows on a CPU, and nothing else may fail there
MISSING_FEATURES = (
    # the CPU gradient scaler of every 16-mixed example: torch >= 2.3
    "AttributeError: module 'torch.amp' has no attribute 'GradScaler'",
    # fp16 autocast on a CPU: torch >= 2.2
    "RuntimeError: Currently, AutocastCPU only support Bfloat16",
    # `torch.is_autocast_enabled(device)`: torch >= 2.4
    "TypeError: torch.is_autocast_enabled() takes no arguments",
)


@pytest.mark.skipif(CPU_16_MIXED, reason="this torch runs every example (test_every_example_runs)")
def test_on_an_old_torch_examples_fail_only_for_what_it_lacks(builds: dict[str, Build]) -> None:
    """On a torch without 16-mixed on CPU the pages' 16-mixed examples cannot run; every other one must, and each
    failure must be one of :data:`MISSING_FEATURES` (so a bf16 or 32-bit example that breaks still fails here)."""
    output = (builds["doctest"].outdir / "output.txt").read_text(encoding="utf-8")
    expected = {DOCUMENT_OF_PAGE[page]: count for page, count in EXPECTED_EXAMPLES.items()}
    results = _doctest_results(output)
    assert {document: sum(counts) for document, counts in results.items()} == expected, output
    assert sum(passed for passed, _ in results.values()) > 0, output
    failures = [block for block in output.split("*" * 70) if "Failed example:" in block]
    assert len(failures) == sum(failed for _, failed in results.values()), output
    unexplained = [block for block in failures if not any(reason in block for reason in MISSING_FEATURES)]
    assert unexplained == [], "\n".join(unexplained)


@requires_cpu_16_mixed  # the pages' 16-mixed examples train on CPU; on an older torch the test above runs instead
def test_every_example_runs(builds: dict[str, Build]) -> None:
    build = builds["doctest"]
    _assert_succeeded(build)
    output = (build.outdir / "output.txt").read_text(encoding="utf-8")

    expected = {DOCUMENT_OF_PAGE[page]: count for page, count in EXPECTED_EXAMPLES.items()}
    assert _doctest_results(output) == {document: (count, 0) for document, count in expected.items()}, output

    summary = output[output.index("Doctest summary") :]
    assert re.search(rf"^\s+{sum(expected.values())} tests$", summary, re.MULTILINE), summary
    for kind in ("tests", "setup code", "cleanup code"):
        assert re.search(rf"^\s+0 failures in {kind}$", summary, re.MULTILINE), summary


# ------------------------------------------------------------------------------------------------------------------
# the sources, without Sphinx
# ------------------------------------------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::(.*)$")


@pytest.mark.parametrize("page", sorted(EXPECTED_EXAMPLES))
def test_every_code_example_is_executed(page: str) -> None:
    """Python on the pages is in ``testcode`` blocks only, each in the page's named group, none skippable."""
    lines = (PAGES / page).read_text(encoding="utf-8").splitlines()
    testcode_groups = []
    for number, line in enumerate(lines, 1):
        directive = _DIRECTIVE.match(line)
        if directive:
            name, argument = directive.group(2), directive.group(3).strip()
            assert name not in ("code-block", "code", "sourcecode", "doctest", "literalinclude"), (
                f"{page}:{number}: a `{name}` block is not executed; write examples as `.. testcode::`"
            )
            if name == "testcode":
                testcode_groups.append(argument)
            continue
        stripped = line.strip()
        if stripped.endswith("::") and not stripped.startswith(".."):
            raise AssertionError(f"{page}:{number}: a literal block (`::`) is not executed; use `.. testcode::`")
        assert not stripped.startswith(":skipif:"), f"{page}:{number}: examples must not be skippable"
    assert len(testcode_groups) == EXPECTED_EXAMPLES[page], f"update EXPECTED_EXAMPLES for {page}"
    # a named group keeps the examples apart from the other blocks of the upstream page that includes them
    assert len(set(testcode_groups)) == 1 and testcode_groups[0], f"{page}: use one named doctest group"


def test_project_links_the_pages_themselves() -> None:
    """``docs/fork`` builds the files in ``docs/source-pytorch``, not copies of them."""
    for page in EXPECTED_EXAMPLES:
        assert (PROJECT / page).resolve() == (PAGES / page).resolve(), f"docs/fork/{page} must link to {PAGES / page}"
    stand_in = (PROJECT / "model" / "manual_optimization.rst").read_text(encoding="utf-8")
    assert INCLUDE_LINE in stand_in.splitlines()


def test_docs_patches_are_well_formed() -> None:
    """The patches to upstream's pages parse, are listed in order, and hook in pages that exist."""
    if str(REPO) not in sys.path:  # `forkbuild` lives at the repository root, which is not a test path
        sys.path.insert(0, str(REPO))
    from forkbuild import patching

    series = patching.read_series(DOCS_PATCHES)
    assert [p.name for p in series] == sorted(p.name for p in DOCS_PATCHES.glob("*.patch")), "docs/patches/series"
    wheel_series = (REPO / "patches" / "series").read_text(encoding="utf-8")
    added: dict[str, list[str]] = {}
    for path in series:
        patch = patching.parse(path.name, path.read_text(encoding="utf-8"))
        assert re.search(r"^Description: \S", patch.header, re.MULTILINE), f"{path.name}: no Description header"
        assert re.search(r"^Forwarded: \S", patch.header, re.MULTILINE), f"{path.name}: no Forwarded header"
        assert path.name not in wheel_series, f"{path.name}: docs patches are not applied to the wheel"
        for file_patch in patch.files:
            assert file_patch.path.startswith(("docs/source-pytorch/", "docs/source-fabric/")), (
                f"{path.name}: {file_patch.path}"
            )
            for hunk in file_patch.hunks:
                new_lines = [line for line in hunk.new if line not in hunk.old]
                added.setdefault(file_patch.path, []).extend(new_lines)

    # 0001: upstream's manual optimization page includes the section with the line the stand-in page uses
    manual = added["docs/source-pytorch/model/manual_optimization.rst"]
    assert f"{INCLUDE_LINE}\n" in manual
    for lines in added.values():
        for line in lines:
            include = re.match(r"\.\. include:: /(\S+)$", line.strip())
            if include:
                assert (PAGES / include.group(1)).is_file(), f"an include of a page that does not exist: {line}"
    # 0002: upstream's conf.py does not read the section as a page of its own
    assert any(f'"{SECTION}"' in line for line in added["docs/source-pytorch/conf.py"])
    # 0003/0004: upstream's precision pages lead to ours
    precision_links = "".join(added["docs/source-pytorch/common/precision.rst"])
    assert "precision_mixed.html" in precision_links
    assert ":ref:`precision_mixed`" in "".join(added["docs/source-pytorch/common/precision_intermediate.rst"])
    # 0005/0006: Fabric's precision and checkpoint guides say what a loop under the scaler gets, and what is saved
    fabric_precision = "".join(added["docs/source-fabric/fundamentals/precision.rst"])
    for api in ("fabric.training_iteration()", "step_was_skipped", "error_if_nonfinite=True", "fabric.backward(loss)"):
        assert api in fabric_precision, api
    assert '``"MixedPrecision"``' in "".join(added["docs/source-fabric/guide/checkpoint/checkpoint.rst"])
    # 0007: the callback the wheel adds is in the API reference and in the list of built-in callbacks
    for page in ("api_references.rst", "extensions/callbacks.rst"):
        assert "    LossScaleMonitor\n" in added[f"docs/source-pytorch/{page}"], page
