"""``python -m forkbuild series-check`` (forkbuild/series_check.py): the series is reviewable one concern at a time,
every patch cited exists, and each check can fail."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forkbuild import series_check as check_series
from forkbuild.series import read_series

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def upstream_package(upstream_files, monkeypatch):
    """The pinned release's package files, from the session's verified wheel (no second download)."""
    package = {name: data for name, data in upstream_files.items() if ".dist-info/" not in name}
    monkeypatch.setattr(check_series, "upstream_package", lambda: dict(package))
    return package


def _series_copy(tmp_path: Path) -> Path:
    patches = tmp_path / "patches"
    shutil.copytree(REPO / "patches", patches)
    return patches


def test_the_series_claims_its_files_says_where_each_went_and_is_written_once():
    patches = read_series(REPO / "patches")
    assert check_series.check_claims(patches, read_series(check_series.TEST_PATCHES)) == []
    again, total, _ = check_series.churn(patches)
    assert total > 0
    assert again / total < check_series.MAX_CHURN
    assert check_series.check_forwarded(patches) == []


def test_a_file_no_patch_claims_is_reported(monkeypatch):
    patches = read_series(REPO / "patches")
    real = check_series.own_files()
    monkeypatch.setattr(check_series, "own_files", lambda: [*real, "tests/tests_pytorch/test_orphan.py"])
    problems = check_series.check_claims(patches, [])
    assert any("tests/tests_pytorch/test_orphan.py belongs to no patch" in p for p in problems)


def test_a_file_claimed_twice_is_reported(tmp_path):
    patches = _series_copy(tmp_path)
    second = patches / "0003-pytree-leaf-spec-without-deprecation.patch"
    text = second.read_text()
    recipe = next(p for p in read_series(patches) if p.stem == "0007-amp-follows-the-recipe").adds()[-1]
    second.write_text(text.replace("Adds: tests/tests_pytorch/utilities/test_pytree_leaf_spec.py",
                                   f"Adds: tests/tests_pytorch/utilities/test_pytree_leaf_spec.py\n {recipe}"))
    problems = check_series.check_claims(read_series(patches), read_series(check_series.TEST_PATCHES))
    both = f"{recipe} is added by both 0003-pytree-leaf-spec-without-deprecation.patch and 0007-amp-follows-the-recipe"
    assert any(both in p for p in problems), problems


def test_churn_counts_the_lines_a_later_patch_removes(tmp_path):
    (tmp_path / "0001-add.patch").write_text(
        "Description: add\n\ndiff --git a/src/lightning/x.py b/src/lightning/x.py\n--- a/src/lightning/x.py\n"
        "+++ b/src/lightning/x.py\n@@ -1 +1,3 @@\n a = 1\n+b = 2\n+c = 3\n"
    )
    (tmp_path / "0002-move.patch").write_text(
        "Description: move\n\ndiff --git a/src/lightning/x.py b/src/lightning/x.py\n--- a/src/lightning/x.py\n"
        "+++ b/src/lightning/x.py\n@@ -1,3 +1,2 @@\n a = 1\n-b = 2\n c = 3\n"
    )
    (tmp_path / "series").write_text("0001-add.patch\n0002-move.patch\n")
    again, total, detail = check_series.churn(read_series(tmp_path))
    assert (again, total) == (1, 2)
    assert detail == ["0002-move.patch removes 1 line(s) an earlier patch added"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("no", None),
        ("not-needed", None),
        ("upstream/rfcs/07-clipping-under-a-scaler.md", None),
        ("upstream/stack/99-no-such-pr", "`Forwarded: upstream/stack/99-no-such-pr` is neither"),
        ("https://example.org/pr/1", "`Forwarded: https://example.org/pr/1` is neither"),
        ("", "has no `Forwarded:` field"),
    ],
)
def test_forwarded_says_where_the_concern_went(tmp_path, value, expected):
    patches = _series_copy(tmp_path)
    clip_norm = patches / "0017-clip-gradients-returns-the-unscaled-norm.patch"
    text = clip_norm.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("Forwarded:"))
    clip_norm.write_text(text.replace(line, f"Forwarded: {value}" if value else "", 1))
    problems = check_series.check_forwarded(read_series(patches))
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1
        assert expected in problems[0]


def test_a_prefix_whose_tests_need_a_later_patch_fails(tmp_path, upstream_package):
    """A test claimed by patch 0004 that needs 0005's hook fails at prefix 1, where the full series passes it."""
    repo = tmp_path / "repo"
    test = repo / "tests" / "tests_fabric" / "test_needs_0002.py"
    test.parent.mkdir(parents=True)
    test.write_text(
        "from lightning.fabric.plugins.precision.precision import Precision\n\n\n"
        "def test_hook():\n    assert hasattr(Precision, 'track_optimizer_wrapper')\n"
    )
    patches = _series_copy(tmp_path)
    first = patches / "0004-precision-training-iteration-hooks.patch"
    claim = "Adds: tests/tests_fabric/test_needs_0002.py\nForwarded:"
    first.write_text(first.read_text().replace("Forwarded:", claim, 1))
    (patches / "series").write_text(
        "0004-precision-training-iteration-hooks.patch\n0005-precision-tracks-optimizer-wrappers.patch\n"
    )
    series = read_series(patches)
    problems = check_series.check_prefixes(series[:1], "new", sys.executable, ["-x"], None, repo=repo)
    assert len(problems) == 1
    assert "prefix 1..1 (up to 0004-precision-training-iteration-hooks.patch) its tests fail" in problems[0]
    # the same test passes once 0009 is in: prefix 1..2 runs every test claimed so far
    assert check_series.check_prefixes(series, "all", sys.executable, ["-x"], None, first=2, repo=repo) == []


def test_every_patch_cited_in_the_patches_markdown_and_docs_exists():
    """``patch 0019``, ``0019-amp-misuse-watch-is-opt-in.patch``, ``patches/0010-...``: each names a patch of its
    series (``make test`` runs the check on the repository)."""
    assert len(check_series.cited_files()) > 20
    assert check_series.check_citations() == []


CITING = """\
Description: cites patches.
 The watch is opt-in (patch 0019); patches 0007 and 0012 hold the recipe (0007-amp-follows-the-recipe.patch,
 patches/0010-..., docs/patches/0002, test patches 0010/0011, ([#18089](https://x/18089), 0007, 0013)).
 Not citations: 2026-12-04-architecture.md, lightning 2.6.6, #1234, issue 0042 of the tracker, 7f0c3436cd,
 upstream/stack/01-stale-autocast-cache, the renumbering 0001-0020, patches 0007-0019.
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("the fuller watch is opt-in (patch 0020)", "cites patches 0020, but patches/series has no patch 0020"),
        ("see patches 0007 and 0021", "cites patches 0021, but patches/series has no patch 0021"),
        ("what it changes (0018, fork-only), and (0023.)", "cites patches 0023, but patches/series has no patch 0023"),
        ("it pins the recipe (0011-amp-follows-the-recipe.patch)",
         ("cites 0011-amp-follows-the-recipe.patch, but patches 0011 is 0011-docstrings-mixed-precision-hooks;",
          "; amp-follows-the-recipe is 0007-amp-follows-the-recipe")),
        ("as 0019-amp-misuse-watch-is-on.patch says", "cites 0019-amp-misuse-watch-is-on.patch, but patches 0019 is"),
        ("as patches/0019-amp-misuse-watch says", None),
        ("as patches/0030-... says", "cites patches 0030, but patches/series has no patch 0030"),
        ("docs/patches/0009 says", "cites docs/patches 0009, but docs/patches/series has no patch 0009"),
        ("test patch 0012", "cites test-patches 0012, but test-patches/series has no patch 0012"),
    ],
)
def test_a_wrong_patch_number_or_slug_is_reported(tmp_path, text, expected):
    repo = tmp_path / "repo"
    for folder in check_series.CITED_SERIES.values():
        shutil.copytree(folder, repo / folder.relative_to(REPO))
    (repo / "NOTES.md").write_text(CITING + text + "\n")
    citing = repo / "patches" / "0018-cpu-16-mixed-is-float16.patch"
    citing.write_text(CITING + text + "\n" + citing.read_text())
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    problems = check_series.check_citations(repo)
    if expected is None:
        assert problems == []
    else:  # in the Markdown and in the patch's header
        assert len(problems) == 2, problems
        assert problems[0].startswith("NOTES.md:6 ")
        assert problems[1].startswith("patches/0018-cpu-16-mixed-is-float16.patch:6 ")
        for part in (expected,) if isinstance(expected, str) else expected:
            assert all(part in problem for problem in problems), (part, problems)


def test_a_citation_on_a_line_a_patch_adds_is_read_and_on_its_context_not():
    text = "Description: patch 0030\n\n--- a/src/x.py\n+++ b/src/x.py\n@@ -1,2 +1,2 @@\n patch 0031\n"
    text += "-patch 0033\n+patch 0032\n"
    found = check_series.citations(check_series.cited_text(text, patch=True))
    assert [(line, number) for line, _, number, _ in found] == [(1, "0030"), (8, "0032")]
