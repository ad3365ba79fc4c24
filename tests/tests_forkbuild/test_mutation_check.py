"""``make mutation-check`` (``tests/mutation_check.py``) stays in step with the code it mutates.

Running the mutations takes minutes (a maintainer's check, like ``make series-check SERIES_TESTS=all``); this test
only checks, on every ``make test``, that each mutation's text occurs exactly once in the fork as installed, so a
change to a mechanism that leaves its mutation behind fails here instead of silently testing nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mutation_check  # tests/mutation_check.py: tests/ is on pytest's pythonpath
import pytest


def test_every_mutation_applies_to_the_installed_fork() -> None:
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("needs the fork installed (make setup)")
    assert mutation_check.stale(mutation_check.installed_package()) == []


def test_a_mutation_that_no_longer_matches_is_reported(tmp_path: Path) -> None:
    package = tmp_path / "lightning"
    (package / "fabric").mkdir(parents=True)
    (package / "fabric" / "x.py").write_text("a = 1\na = 1\n")
    twice, gone = (mutation_check.Mutation(name, "fabric/x.py", (), "", old, "") for name, old in
                   (("twice", "a = 1\n"), ("gone", "b = 2\n")))
    assert mutation_check.stale(package, (twice, gone)) == [
        "twice: its text occurs 2 times in lightning/fabric/x.py",
        "gone: its text occurs 0 times in lightning/fabric/x.py",
    ]


def test_mutation_names_are_unique() -> None:
    names = [m.name for m in mutation_check.MUTATIONS]
    assert len(names) == len(set(names))
