"""The behaviour tests under the standalone import names (``python -m forkbuild standalone-tests``).

``make test`` runs ``tests/tests_pytorch`` and ``tests/tests_fabric`` twice: as written (``lightning.pytorch``,
``lightning.fabric``) and as a renamed copy (``pytorch_lightning``, ``lightning_fabric``). These tests check the copy:
nothing in it still reaches ``lightning``, and its guard fails a test that does.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from forkbuild import standalone_tests

REPO = Path(__file__).resolve().parents[2]
#: an import of (or an attribute path through) the namespaced packages, outside prose
NAMESPACED = re.compile(r"^\s*(from|import)\s+lightning(\.|\s|$)|(?<![\w.`])lightning\.(pytorch|fabric)\b", re.M)


@pytest.fixture(scope="module")
def renamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("standalone") / "tests"
    standalone_tests.generate(REPO / "tests", out, REPO / "pyproject.toml")
    return out


def test_the_copy_holds_every_behaviour_test_but_the_two_name_comparisons(renamed: Path) -> None:
    def tests(root: Path) -> set[str]:
        return {p.relative_to(root).as_posix() for s in standalone_tests.SUITES for p in (root / s).rglob("test_*.py")}

    original = tests(REPO / "tests")
    assert set(standalone_tests.EXCLUDED) <= original
    assert tests(renamed) == original - set(standalone_tests.EXCLUDED)


def test_nothing_in_the_copy_imports_lightning(renamed: Path) -> None:
    offending = {
        p.relative_to(renamed).as_posix(): match.group(0).strip()
        for p in renamed.rglob("*.py")
        if p.name != "conftest.py"
        for match in [NAMESPACED.search(p.read_text())]
        if match
    }
    assert offending == {}
    oracle = (renamed / "amp_oracle" / "trainer.py").read_text()
    assert 'return "pytorch_lightning"' in oracle  # the fork's side of every comparison, renamed


def _pytest(root: Path, test: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(root / "pytest.ini"), "-q", str(root / test)],
        capture_output=True,
        text=True,
        cwd=root,
    )


def test_the_guard_fails_a_test_that_reached_lightning(renamed: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    probe = renamed / "tests_pytorch" / "test_probe_names.py"
    probe.write_text("def test_standalone():\n    import pytorch_lightning\n")
    assert _pytest(renamed, "tests_pytorch/test_probe_names.py").returncode == 0
    probe.write_text("def test_namespaced():\n    import lightning.pytorch\n")
    result = _pytest(renamed, "tests_pytorch/test_probe_names.py")
    probe.unlink()
    assert result.returncode == 1, result.stdout
    assert "this test imported `lightning` in the standalone suite" in result.stdout
