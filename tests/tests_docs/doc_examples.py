"""Run every example of the fork's documentation pages, in order, as a reader would.

The pages write their examples as ``.. code-block:: python`` (which GitHub's rendering of ``.rst`` files shows, where
Sphinx's ``testcode`` blocks vanish), and what an example prints as the ``.. code-block:: text`` right after it. This
module executes a page's Python blocks one after the other in one namespace (so a later block uses what an earlier one
defined), captures what each prints and compares it with its output block, line by line with trailing spaces ignored.

    python tests/tests_docs/doc_examples.py            # every page; exit status 1 if an example fails

``tests/tests_docs/test_docs.py`` runs it too, with the counts of examples per page.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import textwrap
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parents[2]
PAGES = REPO / "docs" / "source-pytorch"  # the pages, in upstream's layout

#: every page with examples, relative to PAGES
PAGE_NAMES = ("model/manual_optimization_mixed_precision.rst", "common/precision_mixed.rst")

_CODE_BLOCK = re.compile(r"^(?P<indent>\s*)\.\.\s+code-block::\s*(?P<language>\S+)\s*$")


@dataclass
class Block:
    language: str  # "python", or "text" for an example's output
    code: str
    line: int  # of the directive, 1-based


@dataclass
class Example:
    code: Block
    output: Optional[Block]  # the text block right after it, if any


@dataclass
class Result:
    example: Example
    error: Optional[str]  # None: it ran, and printed what its output block says


def code_blocks(text: str) -> list[Block]:
    """The ``code-block`` directives of an ``.rst`` text, with their dedented contents, in order."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = _CODE_BLOCK.match(lines[i])
        if not match:
            i += 1
            continue
        indent, start = len(match.group("indent")), i
        i += 1
        while i < len(lines) and re.match(r"^\s+:\w[\w-]*:", lines[i]):  # options (:caption: ...)
            i += 1
        body = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        blocks.append(Block(match.group("language"), textwrap.dedent("\n".join(body)).strip("\n") + "\n", start + 1))
    return blocks


def examples(text: str) -> list[Example]:
    """The Python blocks, each with the text block that follows it directly (its output), if any."""
    blocks = code_blocks(text)
    found = []
    for i, block in enumerate(blocks):
        if block.language != "python":
            continue
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        found.append(Example(block, after if after is not None and after.language == "text" else None))
    return found


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep the output readable: no Trainer banners, no hints about this toy setup; the logger's level and the
    warning filters are restored afterwards (the tests that follow in the same process expect Lightning's info lines)."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    with warnings.catch_warnings():
        logger.setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
        try:
            yield
        finally:
            logger.setLevel(level)


def require_the_fork() -> None:
    """The examples document the fork's behaviour: running them against stock Lightning would prove nothing."""
    import lightning
    from lightning.pytorch.core.optimizer import LightningOptimizer

    if not hasattr(LightningOptimizer, "step_was_skipped"):
        raise RuntimeError(
            f"The examples need the fork's `lightning`, but Python imports stock Lightning {lightning.__version__}"
            f" from {lightning.__file__}. Install the fork (`make install`) or run `make tree` and set"
            " PYTHONPATH=.tree/src."
        )


def _normalized(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def run_page(path: Path) -> list[Result]:
    """Execute the page's examples in order in one namespace; one result per example."""
    require_the_fork()
    namespace: dict = {"__name__": f"doc_example_{path.stem}"}
    results = []
    with _quiet():
        for example in examples(path.read_text(encoding="utf-8")):
            printed = io.StringIO()
            error = None
            try:
                with contextlib.redirect_stdout(printed):
                    exec(compile(example.code.code, f"{path}:{example.code.line}", "exec"), namespace)
            except Exception:
                error = traceback.format_exc()
            if error is None and example.output is not None:
                expected, got = _normalized(example.output.code), _normalized(printed.getvalue())
                if expected != got:
                    error = "expected:\n" + "\n".join(expected) + "\ngot:\n" + "\n".join(got)
            results.append(Result(example, error))
    return results


def main() -> int:
    failed = 0
    for name in PAGE_NAMES:
        started = time.perf_counter()
        results = run_page(PAGES / name)
        bad = [r for r in results if r.error is not None]
        failed += len(bad)
        for result in bad:
            print(f"FAILED {name}:{result.example.code.line}\n{result.error}", file=sys.stderr)
        print(f"{name}: {len(results) - len(bad)} of {len(results)} examples passed"
              f" ({time.perf_counter() - started:.0f} s)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
