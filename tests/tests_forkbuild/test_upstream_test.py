"""upstream/upstream_test.py: the stack PRs' tests merged into the fork's test tree, and which test patch owns a test.

A throwaway git repository in ``tmp_path`` plays upstream master (one test file); a toy PR's ``changes.patch`` is a real
``git diff`` against it; the fork's test tree is a folder whose copy of that file differs from master's. No network, no
pytest run of upstream's suites.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from upstream import upstream_test

MASTER = """\
import torch


def test_kept():
    assert True


def test_changed():
    assert 1 == 1
"""

PR = """\
import torch


def test_kept():
    assert True


@pytest.mark.parametrize("x", [1, 2])
def test_changed(x):
    assert x == x


def test_added():
    assert torch.ones(1).sum() == 1
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def master(tmp_path: Path) -> Path:
    clone = tmp_path / "upstream"
    (clone / "tests" / "tests_pytorch").mkdir(parents=True)
    git(clone, "init", "-q", "-b", "master")
    (clone / "tests" / "tests_pytorch" / "test_thing.py").write_text(MASTER)
    git(clone, "add", "-A")
    git(clone, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "-m", "master")
    return clone


def pr_patch(clone: Path, tmp_path: Path, edits: dict[str, str]) -> Path:
    """A stack folder's ``changes.patch``: ``git diff --full-index`` of ``edits`` against master."""
    for path, text in edits.items():
        (clone / path).parent.mkdir(parents=True, exist_ok=True)
        (clone / path).write_text(text)
    git(clone, "add", "-A")
    patch = tmp_path / "stack" / "01-thing" / "changes.patch"
    patch.parent.mkdir(parents=True)
    patch.write_text(git(clone, "diff", "--cached", "--full-index", "--binary"))
    git(clone, "reset", "-q", "--hard")
    git(clone, "clean", "-fdq")
    return patch


def test_the_tests_a_pr_adds_or_changes(master, tmp_path):
    patch = pr_patch(master, tmp_path, {"tests/tests_pytorch/test_thing.py": PR,
                                        "tests/tests_pytorch/test_new.py": "def test_new():\n    pass\n",
                                        "src/pkg/mod.py": "x = 1\n"})
    files = {item.path: item for item in upstream_test.test_files_of(patch)}
    assert sorted(files) == ["tests/tests_pytorch/test_new.py", "tests/tests_pytorch/test_thing.py"]
    assert files["tests/tests_pytorch/test_new.py"].base_blob == ""
    master_blob = git(master, "rev-parse", "HEAD:tests/tests_pytorch/test_thing.py").strip()
    assert files["tests/tests_pytorch/test_thing.py"].base_blob == master_blob
    # a decorator added above a test, and a new test, are the PR's; an unchanged test is not
    assert upstream_test.changed_tests(PR, files["tests/tests_pytorch/test_thing.py"].added) == ["test_changed",
                                                                                                "test_added"]


def test_a_pr_merges_into_a_fork_tree_that_differs_from_master(master, tmp_path):
    """The fork's copy of the file has its own change (a test patch's); the PR's change merges in beside it."""
    patch = pr_patch(master, tmp_path, {"tests/tests_pytorch/test_thing.py": PR,
                                        "tests/tests_pytorch/test_new.py": "def test_new():\n    pass\n"})
    tree = tmp_path / "fork-tree"
    (tree / "tests" / "tests_pytorch").mkdir(parents=True)
    (tree / "tests" / "tests_pytorch" / "test_thing.py").write_text(MASTER.replace("import torch\n",
                                                                                    "import torch\nimport os\n"))
    nodes, conflicted = upstream_test.merge_pr_tests(master, tree, patch)
    assert sorted(nodes) == ["tests_pytorch/test_new.py", "tests_pytorch/test_thing.py::test_added",
                             "tests_pytorch/test_thing.py::test_changed"]
    assert conflicted == []
    merged = (tree / "tests" / "tests_pytorch" / "test_thing.py").read_text()
    assert "import os\n" in merged and "def test_added():" in merged and "def test_changed(x):" in merged
    assert (tree / "tests" / "tests_pytorch" / "test_new.py").read_text() == "def test_new():\n    pass\n"


def test_a_conflict_keeps_both_sides_the_prs_last(master, tmp_path):
    patch = pr_patch(master, tmp_path, {"tests/tests_pytorch/test_thing.py": PR})
    tree = tmp_path / "fork-tree"
    (tree / "tests" / "tests_pytorch").mkdir(parents=True)
    ours = MASTER.replace("    assert 1 == 1\n", "    assert 2 == 2\n")
    (tree / "tests" / "tests_pytorch" / "test_thing.py").write_text(ours)
    _, conflicted = upstream_test.merge_pr_tests(master, tree, patch)
    assert conflicted == ["tests/tests_pytorch/test_thing.py"]
    merged = (tree / "tests" / "tests_pytorch" / "test_thing.py").read_text()
    assert "<<<<<<<" not in merged
    assert merged.index("assert 2 == 2") < merged.index("def test_changed(x):")  # the PR's definition comes last


@pytest.mark.parametrize(("test_id", "node", "expected"), [
    ("tests_pytorch.test_thing::test_changed[1]", "tests_pytorch/test_thing.py::test_changed", True),
    ("tests.tests_pytorch.test_thing::test_changed", "tests_pytorch/test_thing.py::test_changed", True),
    ("tests_pytorch.test_thing::test_changed_more", "tests_pytorch/test_thing.py::test_changed", False),
    ("tests_pytorch.test_thing.TestGroup::test_one", "tests_pytorch/test_thing.py::TestGroup", True),
    ("tests_pytorch.test_thing::(collection)", "tests_pytorch/test_thing.py::test_changed", True),
    ("tests_pytorch.test_new::test_new", "tests_pytorch/test_new.py", True),
    ("tests_pytorch.test_other::test_new", "tests_pytorch/test_new.py", False),
])
def test_junit_ids_belong_to_pytest_nodes(test_id, node, expected):
    assert upstream_test._is_node(test_id, node) is expected


def test_a_failure_is_owned_by_the_patch_that_changes_that_test():
    owned = {"tests_fabric/test_connector.py::test_precision_selection_16_on_cpu_warns": "0011-x.patch"}
    assert upstream_test.owner("tests_fabric.test_connector::test_precision_selection_16_on_cpu_warns", owned) == \
        "0011-x.patch"
    # another test of the same file is not owned: a test patch owns the tests it changes, not their whole file
    assert upstream_test.owner("tests_fabric.test_connector::test_precision_selection_amp_ddp[a]", owned) == ""
    before = {"tests_fabric.test_connector::test_precision_selection_16_on_cpu_warns": "passed",
              "tests_fabric.test_connector::test_other": "passed"}
    after = dict.fromkeys(before, "failed")
    files = upstream_test.dotted_modules(["tests/tests_fabric/test_connector.py"])
    result = upstream_test.compare(before, after, files, owned)
    assert result["regressions_in_test_patched_files"] == [
        "tests_fabric.test_connector::test_precision_selection_16_on_cpu_warns"]
    assert result["regressions"] == ["tests_fabric.test_connector::test_other"]


def test_the_repository_stack_is_listed_in_merge_order():
    names = [name for name, _ in upstream_test.stack_prs()]
    assert names == ["01-stale-autocast-cache", "05-manual-backward-outside-autocast",
                     "04-clip-gradients-unscales-first", "03-fused-optimizers-under-scaler",
                     "06-fabric-step-methods-under-precision", "07-fabric-clip-gradients-under-a-scaler",
                     "08-fabric-checkpoint-saves-the-scaler"]
    for _, patch in upstream_test.stack_prs():
        assert upstream_test.test_files_of(patch), f"{patch.parent.name} changes no test file"
