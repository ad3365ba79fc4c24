"""``python -m forkbuild series-check`` (forkbuild/series_check.py): the series is reviewable one concern at a time,
and each check can fail."""

import shutil
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

