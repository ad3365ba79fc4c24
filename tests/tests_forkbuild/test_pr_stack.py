"""upstream/pr_stack.py (``make pr-stack``): one branch per folder of the PR stack, each on the base alone.

Each test builds a throwaway git repository in ``tmp_path`` as the "upstream" (a module, a test file, a docs page) and
a stack folder of toy PRs whose ``changes.patch`` is a real ``git diff`` against it, and runs the script in a
subprocess as ``make pr-stack`` does; no network. The last tests check the repository's real stack folders.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from upstream import pr_stack

REPO = Path(__file__).resolve().parents[2]
#: ``make pr-stack``'s command, run from the repository root
SCRIPT = [sys.executable, "-m", "upstream.pr_stack"]

DESCRIPTION = """\
## What does this PR do?

Fixes the widget so that it {what}.
Second line of the first paragraph.

Fixes {closes}

Merge order: after the PRs before it, if any.

## Evidence

Measured before and after.
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def upstream(tmp_path: Path) -> Path:
    """A tiny upstream: master with a module, a test file and a docs page, plus an untracked file of the user's."""
    clone = tmp_path / "upstream"
    clone.mkdir()
    git(clone, "init", "-q", "-b", "master")
    git(clone, "config", "user.name", "Upstream Maintainer")
    git(clone, "config", "user.email", "maintainer@example.com")
    (clone / "src" / "pkg").mkdir(parents=True)
    (clone / "src" / "pkg" / "widget.py").write_text("def widget():\n    return 1\n")
    (clone / "tests" / "tests_pytorch").mkdir(parents=True)
    (clone / "tests" / "tests_pytorch" / "test_widget.py").write_text("def test_widget():\n    assert True\n")
    (clone / "docs").mkdir()
    (clone / "docs" / "widget.rst").write_text("Widget\n======\n")
    git(clone, "add", "-A")
    git(clone, "commit", "-q", "-m", "base")
    (clone / "notes.txt").write_text("the maintainer's own untracked file\n")
    return clone


def base_of(clone: Path) -> str:
    return git(clone, "rev-parse", "master").strip()


def diff_of(clone: Path, edits: dict[str, str]) -> str:
    """``git diff --binary`` of ``edits`` (path -> new content) against master, made in a scratch clone."""
    scratch = clone.parent / f"scratch-{len(list(clone.parent.iterdir()))}"
    subprocess.run(["git", "clone", "-q", str(clone), str(scratch)], check=True)
    for path, text in edits.items():
        (scratch / path).parent.mkdir(parents=True, exist_ok=True)
        (scratch / path).write_text(text)
    git(scratch, "add", "-A")
    return git(scratch, "diff", "--cached", "--binary")


def add_pr(stack: Path, folder: str, patch: str, *, title: str = "Fix the widget", closes: tuple[str, ...] = ("#101",),
           description: str | None = None, merge_order: int | None = None) -> Path:
    pr = stack / folder
    pr.mkdir(parents=True)
    slug = folder.split("-", 1)[1]
    closes_toml = ", ".join(f'"{c}"' for c in closes)
    order = int(folder[:2]) if merge_order is None else merge_order
    (pr / "pr.toml").write_text(f'branch = "amp/{slug}"\ntitle = "{title}"\ncloses = [{closes_toml}]\n'
                                f'merge_order = {order}\ntouches_tests = ["tests/tests_pytorch/test_widget.py"]\n')
    (pr / "changes.patch").write_text(patch)
    (pr / "description.md").write_text(description or DESCRIPTION.format(what=slug, closes=" ".join(closes)))
    return pr


def toy_stack(clone: Path, stack: Path) -> None:
    add_pr(stack, "01-widget-returns-two", diff_of(clone, {
        "src/pkg/widget.py": "def widget():\n    return 2\n",
        "tests/tests_pytorch/test_widget.py": "def test_widget():\n    assert widget() == 2\n",
    }), title="Return two from the widget")
    add_pr(stack, "02-widget-docs", diff_of(clone, {
        "docs/widget.rst": "Widget\n======\n\nIt returns a number.\n",
        "tests/tests_pytorch/test_new.py": "def test_new():\n    pass\n",
    }), title="Document the widget", closes=("#102", "#103"))


def run_stack(clone: Path, stack: Path, out: Path, *extra: str, code: int | None = 0) -> subprocess.CompletedProcess:
    """``make pr-stack``'s script on ``stack``; it must exit with ``code`` (unless None)."""
    done = subprocess.run([*SCRIPT, "--upstream", str(clone), "--stack", str(stack), "--base", base_of(clone),
                           "--out", str(out), *extra], capture_output=True, text=True, cwd=REPO)
    assert code is None or done.returncode == code, done.stderr
    return done


def clone_state(clone: Path) -> tuple[str, str, str, str]:
    return (git(clone, "symbolic-ref", "HEAD"), git(clone, "rev-parse", "HEAD"),
            git(clone, "status", "--porcelain", "--untracked-files=all"), git(clone, "branch", "--list"))


def assert_refused(clone: Path, stack: Path, out: Path, message: str) -> None:
    """The run fails (exit 1) with ``message`` and leaves the clone as it was, writing no manifest."""
    before = clone_state(clone)
    assert message in run_stack(clone, stack, out, code=1).stderr
    assert clone_state(clone) == before
    assert not (out / "stack.json").exists()


def test_one_branch_per_folder_each_on_the_base_alone(upstream, tmp_path):
    toy_stack(upstream, tmp_path / "stack")
    before = clone_state(upstream)
    run_stack(upstream, tmp_path / "stack", tmp_path / "out")
    base = base_of(upstream)
    for branch in ("amp/widget-returns-two", "amp/widget-docs"):
        assert git(upstream, "rev-list", "--count", f"{base}..{branch}").strip() == "1"
        assert git(upstream, "rev-parse", f"{branch}^").strip() == base  # on the base, not on the PR before it
    assert git(upstream, "show", "amp/widget-returns-two:src/pkg/widget.py") == "def widget():\n    return 2\n"
    assert git(upstream, "diff", "--name-only", base, "amp/widget-docs").split() == [
        "docs/widget.rst", "tests/tests_pytorch/test_new.py"]
    # the commit: subject = title, body = the description's first paragraph and one Fixes line per issue
    message = git(upstream, "log", "-1", "--format=%B", "amp/widget-docs")
    assert message == ("Document the widget\n\nFixes the widget so that it widget-docs.\nSecond line of the first"
                       " paragraph.\n\nFixes #102\nFixes #103\n\n")
    assert git(upstream, "log", "-1", "--format=%an", "amp/widget-docs").strip() == "Upstream Maintainer"
    # the clone is as it was: the same branch checked out, the same status (the untracked file too)
    after = clone_state(upstream)
    assert after[:3] == before[:3]
    assert (upstream / "src" / "pkg" / "widget.py").read_text() == "def widget():\n    return 1\n"


def test_stack_json(upstream, tmp_path):
    toy_stack(upstream, tmp_path / "stack")
    run_stack(upstream, tmp_path / "stack", tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "stack.json").read_text())
    assert manifest["base"] == base_of(upstream)
    first, second = manifest["prs"]
    assert first == {
        "branch": "amp/widget-returns-two", "title": "Return two from the widget", "closes": ["#101"],
        "description": str(tmp_path / "stack" / "01-widget-returns-two" / "description.md"),
        "lines": {"src": 2, "tests": 2, "docs": 0}, "merge_order": 1,
        "commit": git(upstream, "rev-parse", "amp/widget-returns-two").strip(),
        "in_order_commit": git(upstream, "rev-parse", "amp/stack-in-order~1").strip(), "union_merged": [],
    }
    assert second["closes"] == ["#102", "#103"]
    assert second["lines"] == {"src": 0, "tests": 2, "docs": 2}
    assert second["in_order_commit"] == git(upstream, "rev-parse", "amp/stack-in-order").strip()
    assert manifest["order"] == ["01-widget-returns-two", "02-widget-docs"]


def two_line_upstream(clone: Path) -> None:
    """A second commit on master: a module of two functions and a CHANGELOG."""
    (clone / "src" / "pkg" / "pair.py").write_text("def first():\n    return 1\n\n\n\ndef second():\n    return 1\n")
    (clone / "CHANGELOG.md").write_text("# Changelog\n\n### Fixed\n\n-\n\n### Removed\n")
    git(clone, "add", "-A")
    git(clone, "commit", "-q", "-m", "pair")


def test_each_pr_merges_in_order_onto_its_predecessors(upstream, tmp_path):
    """The in-order branch: one commit per PR in merge order (not folder order), each PR's change merged onto its
    predecessors'; each PR's own branch is still on the base alone."""
    two_line_upstream(upstream)
    stack = tmp_path / "stack"
    pair = "def first():\n    return {}\n\n\n\ndef second():\n    return {}\n"
    add_pr(stack, "01-second", diff_of(upstream, {"src/pkg/pair.py": pair.format(1, 2)}), merge_order=2)
    add_pr(stack, "02-first", diff_of(upstream, {"src/pkg/pair.py": pair.format(2, 1)}), merge_order=1)
    run_stack(upstream, stack, tmp_path / "out")
    base = base_of(upstream)
    assert git(upstream, "rev-parse", "amp/second^").strip() == base
    assert git(upstream, "rev-list", "--count", f"{base}..amp/stack-in-order").strip() == "2"
    assert git(upstream, "show", "amp/stack-in-order:src/pkg/pair.py") == pair.format(2, 2)
    assert git(upstream, "show", "amp/stack-in-order~1:src/pkg/pair.py") == pair.format(2, 1)  # 02-first, order 1
    assert "after: 02-first" in git(upstream, "log", "-1", "--format=%B", "amp/stack-in-order")
    manifest = json.loads((tmp_path / "out" / "stack.json").read_text())
    assert manifest["order"] == ["02-first", "01-second"]


def test_a_conflict_in_order_fails_naming_the_pr_and_its_predecessors(upstream, tmp_path):
    """Each PR applies to the base alone, but the second one's change conflicts with the first's: refused."""
    two_line_upstream(upstream)
    stack = tmp_path / "stack"
    pair = "def first():\n    return {}\n\n\n\ndef second():\n    return 1\n"
    add_pr(stack, "01-two", diff_of(upstream, {"src/pkg/pair.py": pair.format(2)}))
    add_pr(stack, "02-three", diff_of(upstream, {"src/pkg/pair.py": pair.format(3)}))
    assert_refused(upstream, stack, tmp_path / "out",
                   "02-three: does not merge in order (after 01-two): src/pkg/pair.py conflicts")


def test_changelog_entries_of_two_prs_are_both_kept_in_order(upstream, tmp_path):
    two_line_upstream(upstream)
    stack = tmp_path / "stack"
    log = "# Changelog\n\n### Fixed\n\n- {}\n\n### Removed\n"
    add_pr(stack, "01-a", diff_of(upstream, {"CHANGELOG.md": log.format("Fixed a")}))
    add_pr(stack, "02-b", diff_of(upstream, {"CHANGELOG.md": log.format("Fixed b")}))
    done = run_stack(upstream, stack, tmp_path / "out")
    assert git(upstream, "show", "amp/stack-in-order:CHANGELOG.md") == log.format("Fixed a\n- Fixed b")
    manifest = json.loads((tmp_path / "out" / "stack.json").read_text())
    assert [pr["union_merged"] for pr in manifest["prs"]] == [[], ["CHANGELOG.md"]]
    assert "kept both sides of CHANGELOG.md" in done.stdout


def test_the_same_change_in_two_prs_merges_once(upstream, tmp_path):
    """Two PRs that each need the same helper (safe in any merge order) carry it both; in order it is there once."""
    stack = tmp_path / "stack"
    helper = "def widget():\n    return 1\n\n\ndef helper():\n    return 0\n"
    add_pr(stack, "01-a", diff_of(upstream, {"src/pkg/widget.py": helper}))
    add_pr(stack, "02-b", diff_of(upstream, {"src/pkg/widget.py": helper, "docs/widget.rst": "W\n"}))
    run_stack(upstream, stack, tmp_path / "out")
    assert git(upstream, "show", "amp/stack-in-order:src/pkg/widget.py") == helper


@pytest.mark.parametrize(("orders", "message"), [
    ((1, 1), "merge_order must number the PRs 1..2, each once (found 01-a=1, 02-b=1)"),
    ((1, 3), "merge_order must number the PRs 1..2"),
])
def test_the_merge_order_numbers_the_prs(upstream, tmp_path, orders, message):
    stack = tmp_path / "stack"
    add_pr(stack, "01-a", diff_of(upstream, {"src/pkg/widget.py": "x = 1\n"}), merge_order=orders[0])
    add_pr(stack, "02-b", diff_of(upstream, {"docs/widget.rst": "W\n"}), merge_order=orders[1])
    done = run_stack(upstream, stack, tmp_path / "out", code=1)
    assert message in done.stderr


def test_a_later_pr_states_its_merge_order(upstream, tmp_path):
    stack = tmp_path / "stack"
    add_pr(stack, "01-a", diff_of(upstream, {"src/pkg/widget.py": "x = 1\n"}))
    add_pr(stack, "02-b", diff_of(upstream, {"docs/widget.rst": "W\n"}), description="Document it.\n\nFixes #101\n")
    done = run_stack(upstream, stack, tmp_path / "out", code=1)
    assert "02-b: description.md does not state the merge order" in done.stderr


@pytest.mark.parametrize(("top", "path", "limit"), [
    ("src", "src/pkg/big.py", 400), ("tests", "tests/tests_pytorch/test_big.py", 600), ("docs", "docs/big.rst", 300),
])
def test_a_limit_fails_naming_the_pr_and_the_limit(upstream, tmp_path, top, path, limit):
    stack = tmp_path / "stack"
    toy_stack(upstream, stack)
    add_pr(stack, "03-too-big", diff_of(upstream, {path: "x = 1\n" * (limit + 1)}))
    # checked before any branch is made
    assert_refused(upstream, stack, tmp_path / "out",
                   f"03-too-big: {limit + 1} changed lines under {top}/, over the limit of {limit}")


def test_a_description_over_300_words_fails(upstream, tmp_path):
    stack = tmp_path / "stack"
    long = DESCRIPTION.format(what="works", closes="#101") + "word " * 300
    add_pr(stack, "01-wordy", diff_of(upstream, {"src/pkg/widget.py": "x = 1\n"}), description=long)
    done = run_stack(upstream, stack, tmp_path / "out", code=1)
    assert f"01-wordy: description.md has {pr_stack.words(long)} words, over the limit of 300" in done.stderr
    assert pr_stack.words("one <!-- a comment\nof many words --> two") == 2


def test_the_issue_draft_a_pr_names_must_exist(upstream, tmp_path):
    stack = tmp_path / "ours" / "stack"
    pr = add_pr(stack, "01-widget", diff_of(upstream, {"src/pkg/widget.py": "x = 1\n"}))
    with (pr / "pr.toml").open("a") as toml:
        toml.write('issue = "01-widget.md"\n')
    done = run_stack(upstream, stack, tmp_path / "out", code=1)
    assert "01-widget/pr.toml: issue = '01-widget.md': no such file in" in done.stderr

    (tmp_path / "ours" / "issues").mkdir()
    (tmp_path / "ours" / "issues" / "01-widget.md").write_text("# The widget returns one\n")
    run_stack(upstream, stack, tmp_path / "out")


def test_check_requires_every_pr_to_name_its_issue_draft(upstream, tmp_path):
    add_pr(tmp_path / "stack", "01-widget", diff_of(upstream, {"src/pkg/widget.py": "x = 1\n"}))
    done = subprocess.run([*SCRIPT, "--check", "--stack", str(tmp_path / "stack")],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1
    assert "01-widget/pr.toml: no `issue`" in done.stderr


def test_exactly_at_the_limit_passes(upstream, tmp_path):
    add_pr(tmp_path / "stack", "01-at-the-limit", diff_of(upstream, {"src/pkg/big.py": "x = 1\n" * 400}))
    run_stack(upstream, tmp_path / "stack", tmp_path / "out")


def test_a_patch_that_does_not_apply_leaves_the_clone_as_it_was(upstream, tmp_path):
    stack = tmp_path / "stack"
    toy_stack(upstream, stack)
    # written against another base: the context does not match master
    stale = diff_of(upstream, {"src/pkg/widget.py": "def widget():\n    return 2\n"}).replace("return 1", "return 7")
    add_pr(stack, "03-stale", stale)
    # the branches of 01 and 02, made before 03 failed, are gone again
    assert_refused(upstream, stack, tmp_path / "out", "03-stale: changes.patch does not apply to the base")


def test_an_existing_branch_is_refused_and_replaced_with_force(upstream, tmp_path):
    toy_stack(upstream, tmp_path / "stack")
    git(upstream, "branch", "amp/widget-docs")
    done = run_stack(upstream, tmp_path / "stack", tmp_path / "out", code=2)
    assert "02-widget-docs: branch amp/widget-docs exists" in done.stderr
    assert "--force" in done.stderr
    assert git(upstream, "branch", "--list", "amp/widget-returns-two") == ""
    done = run_stack(upstream, tmp_path / "stack", tmp_path / "out", "--force")
    assert git(upstream, "rev-list", "--count", "master..amp/widget-docs").strip() == "1"


def test_a_replaced_branch_is_restored_on_failure(upstream, tmp_path):
    stack = tmp_path / "stack"
    toy_stack(upstream, stack)
    git(upstream, "branch", "amp/widget-returns-two")
    old = git(upstream, "rev-parse", "amp/widget-returns-two")
    add_pr(stack, "03-stale", "diff --git a/src/pkg/gone.py b/src/pkg/gone.py\n--- a/src/pkg/gone.py\n"
           "+++ b/src/pkg/gone.py\n@@ -1 +1 @@\n-a\n+b\n")
    run_stack(upstream, stack, tmp_path / "out", "--force", code=1)
    assert git(upstream, "rev-parse", "amp/widget-returns-two") == old
    assert git(upstream, "branch", "--list", "amp/widget-docs") == ""


TOML = 'branch = "amp/{}"\ntitle = "{}"\ncloses = [{}]\nmerge_order = 1\ntouches_tests = [{}]\n'


@pytest.mark.parametrize(("toml", "message"), [
    (TOML.format("other", "T", '"#1"', ""), "expected 'amp/widget'"),
    ('branch = "amp/widget"\ntitle = "T"\ncloses = ["1"]\nmerge_order = 1\ntouches_tests = []\n', "closes = ['1']"),
    ('branch = "amp/widget"\ntitle = "T"\ncloses = ["#1"]\nmerge_order = 1\n', "key 'touches_tests' missing"),
    ('branch = "amp/widget"\ntitle = "T"\ncloses = ["#1"]\ntouches_tests = []\n', "key 'merge_order' missing"),
    (TOML.format("widget", "x" * 72, '"#1"', ""), "under 72 characters"),
    (TOML.format("widget", "T", '"#1"', '"src/x.py"'), "not an upstream test"),
])
def test_pr_toml_is_checked(upstream, tmp_path, toml, message):
    pr = add_pr(tmp_path / "stack", "01-widget", diff_of(upstream, {"src/pkg/widget.py": "x = 2\n"}))
    (pr / "pr.toml").write_text(toml)
    done = run_stack(upstream, tmp_path / "stack", tmp_path / "out", code=1)
    assert "01-widget/pr.toml" in done.stderr
    assert message in done.stderr


@pytest.mark.parametrize(("words", "what"), [
    ("This keeps promise 2.", "a promise of our design"),
    ("As patch 0005 does.", "a patch number of our series"),
    ("Our stock_pytorch_lightning copy.", "our test-only stock copies"),
    ("Filed as issue 20.", "an issue of our own tracker"),
    ("See #7 for more.", "an issue of our own tracker"),
    ("The fork does it.", "the fork"),
])
def test_words_about_our_own_process_are_refused(words, what):
    assert any(found.startswith(what) for found in pr_stack.own_words(words)), pr_stack.own_words(words)


def test_upstream_words_pass():
    text = "Fixes #21616. torch fixed it in pytorch#94060; see #5558 and Lightning-AI/pytorch-lightning#19803."
    assert pr_stack.own_words(text) == []


def test_test_files_do_not_import_across_suites(upstream, tmp_path):
    add_pr(tmp_path / "stack", "01-widget", diff_of(upstream, {
        "tests/tests_pytorch/test_cross.py": "from tests_fabric.helpers.runif import RunIf\n"}))
    done = run_stack(upstream, tmp_path / "stack", tmp_path / "out", code=1)
    assert "tests/tests_pytorch/test_cross.py imports tests_fabric" in done.stderr


def test_the_repository_stack_is_well_formed():
    """The real folders of upstream/stack/: pr.toml, description, patch and limits (CI runs this)."""
    done = subprocess.run([*SCRIPT, "--check"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    folders = sorted(p.name for p in pr_stack.STACK.iterdir() if p.is_dir())
    assert folders, "upstream/stack/ holds no PR"
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == folders
