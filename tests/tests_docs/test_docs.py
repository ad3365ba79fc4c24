"""The fork's documentation builds with Sphinx without a single warning, shows its examples where users read it, and
every example on its pages runs.

The pages are ``docs/source-pytorch/model/manual_optimization_mixed_precision.rst`` (a section that upstream's manual
optimization page includes, through ``docs/patches/0001``) and ``docs/source-pytorch/common/precision_mixed.rst``.

* Examples are ``.. code-block:: python`` blocks, each followed by a ``.. code-block:: text`` of what it prints where
  it prints something. GitHub renders ``.rst`` files with docutils and drops what docutils does not know (Sphinx's
  ``testcode``), so the pages are rendered here with plain docutils, errors quiet, and every block must show.
* ``doc_examples.py`` executes every Python block of a page in order, in one namespace, against the fork's
  ``lightning`` and compares what it prints; the number of examples per page is exactly :data:`EXPECTED_EXAMPLES` (a
  block that stops being executed, or a new one nobody counted, fails the test).
* The Sphinx project ``docs/fork`` (see its ``conf.py``) builds them with ``-b html -W --keep-going -n``: no
  warning, every cross-reference resolved.
* Notes mark what only the fork has (``2.6.6+amp.1``), and the docs patches are well-formed and point at files that
  exist.

The HTML build takes about 10 s and the examples about 15-30 s on two cores, most of it importing torch and Lightning.
Sphinx comes from ``requirements/docs.txt``. Without it the build is skipped, unless ``requirements/test.txt`` pulls
in ``docs.txt`` or ``CI`` is set: then a missing Sphinx fails.
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
from amp_oracle.torch_features import CPU_16_MIXED, requires_cpu_16_mixed

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_examples  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PAGES = REPO / "docs" / "source-pytorch"  # the pages, in upstream's layout
PROJECT = REPO / "docs" / "fork"  # the fork's Sphinx project: conf.py, index, links to the pages
DOCS_PATCHES = REPO / "docs" / "patches"

#: Python blocks per page, every one executed by doc_examples.py
EXPECTED_EXAMPLES = {
    "model/manual_optimization_mixed_precision.rst": 18,
    "common/precision_mixed.rst": 8,
}
assert set(EXPECTED_EXAMPLES) == set(doc_examples.PAGE_NAMES)
#: what only the fork has, and where a note must say so (a ``.. note::`` naming the fork's version and the API)
FORK_ONLY = {
    "model/manual_optimization_mixed_precision.rst": (
        "step_was_skipped", "clip_gradients", "LossScaleMonitor", 'precision="16-mixed"',
    ),
    "common/precision_mixed.rst": ("step_was_skipped", "LossScaleMonitor"),
}  # fmt: skip
FORK_VERSION = "2.6.6+amp.1"
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
    """``-b html`` of ``docs/fork``, in a fresh folder."""
    _require_sphinx()
    root = tmp_path_factory.mktemp("docs")
    running = {}
    for builder in ("html",):
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
    # every example is shown, highlighted as Python
    for page, html in (("model/manual_optimization_mixed_precision.rst", manual), ("common/precision_mixed.rst", precision)):
        assert html.count('class="highlight-python') == EXPECTED_EXAMPLES[page], page


#: how an example fails on a torch that lacks a feature it shows on a CPU, and nothing else may fail there
MISSING_FEATURES = (
    # the CPU gradient scaler of every 16-mixed example: torch >= 2.3
    "AttributeError: module 'torch.amp' has no attribute 'GradScaler'",
    # fp16 autocast on a CPU: torch >= 2.2
    "RuntimeError: Currently, AutocastCPU only support Bfloat16",
    # `torch.is_autocast_enabled(device)`: torch >= 2.4
    "TypeError: torch.is_autocast_enabled() takes no arguments",
)


@pytest.fixture(scope="module")
def example_results() -> dict[str, list[doc_examples.Result]]:
    return {page: doc_examples.run_page(PAGES / page) for page in EXPECTED_EXAMPLES}


@pytest.mark.skipif(CPU_16_MIXED, reason="this torch runs every example (test_every_example_runs)")
def test_on_an_old_torch_examples_fail_only_for_what_it_lacks(example_results) -> None:
    """On a torch without 16-mixed on CPU the pages' 16-mixed examples cannot run; every other one must, and each
    failure must be one of :data:`MISSING_FEATURES` (so a bf16 or 32-bit example that breaks still fails here)."""
    assert {page: len(results) for page, results in example_results.items()} == EXPECTED_EXAMPLES
    assert any(r.error is None for results in example_results.values() for r in results)
    unexplained = [
        f"{page}:{r.example.code.line}\n{r.error}"
        for page, results in example_results.items()
        for r in results
        if r.error is not None and not any(reason in r.error for reason in MISSING_FEATURES)
    ]
    assert unexplained == [], "\n".join(unexplained)


@requires_cpu_16_mixed  # the pages' 16-mixed examples train on CPU; on an older torch the test above runs instead
def test_every_example_runs(example_results) -> None:
    assert {page: len(results) for page, results in example_results.items()} == EXPECTED_EXAMPLES
    failed = [
        f"{page}:{r.example.code.line}\n{r.error}"
        for page, results in example_results.items()
        for r in results
        if r.error is not None
    ]
    assert failed == [], "\n".join(failed)


def test_the_runner_fails_a_wrong_output_and_an_exception(tmp_path: Path) -> None:
    """doc_examples.py compares what a block prints with the text block after it, and reports an exception."""
    page = tmp_path / "page.rst"
    page.write_text(
        "Title\n=====\n\n.. code-block:: python\n\n    x = 2\n    print(x)\n\n.. code-block:: text\n\n    2\n\n"
        "* in a list:\n\n  .. code-block:: python\n\n      print(x + 1)\n\n  .. code-block:: text\n\n      4\n\n"
        ".. code-block:: python\n\n    raise ValueError('boom')\n",
        encoding="utf-8",
    )
    results = doc_examples.run_page(page)
    assert [r.error is None for r in results] == [True, False, False]
    assert "expected:\n4\ngot:\n3" in results[1].error
    assert "ValueError: boom" in results[2].error


@pytest.mark.parametrize("page", sorted(EXPECTED_EXAMPLES))
def test_github_shows_every_example(page: str) -> None:
    """Rendered as GitHub renders ``.rst`` (docutils; unknown roles and directives dropped quietly), the page shows
    each example and each output."""
    docutils_core = pytest.importorskip("docutils.core")
    source = (PAGES / page).read_text(encoding="utf-8")
    html = docutils_core.publish_string(
        source, writer_name="html", settings_overrides={"report_level": 5, "halt_level": 5}
    ).decode()
    blocks = doc_examples.code_blocks(source)
    assert html.count('<pre class="code python literal-block">') == EXPECTED_EXAMPLES[page]
    assert html.count('<pre class="code text literal-block">') == sum(b.language == "text" for b in blocks)


@pytest.mark.parametrize("page", sorted(FORK_ONLY))
def test_fork_only_apis_are_marked(page: str) -> None:
    """Each API that stock Lightning 2.6.6 lacks is named in a note that names the fork's version."""
    lines = (PAGES / page).read_text(encoding="utf-8").splitlines()
    notes = []
    for number, line in enumerate(lines):
        if line.strip() == ".. note::":
            indent = len(line) - len(line.lstrip())
            body = []
            for following in lines[number + 1 :]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent:
                    break
                body.append(following.strip())
            notes.append(" ".join(body))
    fork_notes = [note for note in notes if FORK_VERSION in note]
    assert fork_notes, f"{page}: no note names {FORK_VERSION}"
    for api in FORK_ONLY[page]:
        assert any(api in note for note in fork_notes), f"{page}: no note marks {api} as the fork's"


# ------------------------------------------------------------------------------------------------------------------
# the sources, without Sphinx
# ------------------------------------------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::(.*)$")


@pytest.mark.parametrize("page", sorted(EXPECTED_EXAMPLES))
def test_every_code_example_is_executed(page: str) -> None:
    """Code on the pages is in ``code-block`` directives only: ``python`` (executed by doc_examples.py) or ``text``
    right after one (what it prints, compared); no other kind of block that would escape the run."""
    lines = (PAGES / page).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        directive = _DIRECTIVE.match(line)
        if directive:
            name, argument = directive.group(2), directive.group(3).strip()
            assert name not in ("code", "sourcecode", "doctest", "literalinclude", "testcode", "testoutput",
                                "testsetup"), f"{page}:{number}: write examples as `.. code-block:: python`"
            if name == "code-block":
                assert argument in ("python", "text"), f"{page}:{number}: a `{argument}` block is not executed"
            continue
        stripped = line.strip()
        if stripped.endswith("::") and not stripped.startswith(".."):
            raise AssertionError(f"{page}:{number}: a literal block (`::`) is not executed; use `.. code-block::`")
    blocks = doc_examples.code_blocks("\n".join(lines))
    for before, block in zip([None, *blocks], blocks):
        if block.language == "text":
            assert before is not None and before.language == "python", f"{page}:{block.line}: output of nothing"
    assert sum(b.language == "python" for b in blocks) == EXPECTED_EXAMPLES[page], f"update EXPECTED_EXAMPLES for {page}"


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
    for api in ("step_was_skipped", "error_if_nonfinite=True", "fabric.backward(loss)"):
        assert api in fabric_precision, api
    assert '``"MixedPrecision"``' in "".join(added["docs/source-fabric/guide/checkpoint/checkpoint.rst"])
    # 0007: the callback the wheel adds is in the API reference and in the list of built-in callbacks
    for page in ("api_references.rst", "extensions/callbacks.rst"):
        assert "    LossScaleMonitor\n" in added[f"docs/source-pytorch/{page}"], page
