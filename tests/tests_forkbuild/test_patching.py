"""The strict patch applier (forkbuild.patching): parsing, applying, refusing; and agreement with ``git apply``."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from forkbuild.patching import PatchError, apply_file, apply_series, parse, read_series

GIT = shutil.which("git")
needs_git = pytest.mark.skipif(GIT is None, reason="git is not installed")


def _numbered(n: int, start: int = 1) -> str:
    return "".join(f"line {i}\n" for i in range(start, start + n))


SIMPLE = (
    "Why: an example header, as in DEP-3.\n"
    "Upstream: not forwarded\n"
    "\n"
    "--- a/src/lightning/x.py\n"
    "+++ b/src/lightning/x.py\n"
    "@@ -3,3 +3,4 @@\n"
    " line 3\n"
    " line 4\n"
    "+inserted\n"
    " line 5\n"
    "@@ -10,3 +11,3 @@\n"
    " line 10\n"
    "-line 11\n"
    "+LINE 11\n"
    " line 12\n"
)


def _apply(text: str, patch_text: str, name: str = "p.patch") -> str:
    patch = parse(name, patch_text)
    assert len(patch.files) == 1
    return apply_file(patch, patch.files[0], text)


# --- parsing ----------------------------------------------------------------------------------------------------------


def test_parse_header_files_and_hunks() -> None:
    patch = parse("0001-x.patch", SIMPLE)
    assert patch.name == "0001-x.patch"
    assert patch.header == "Why: an example header, as in DEP-3.\nUpstream: not forwarded\n\n"
    assert [f.path for f in patch.files] == ["src/lightning/x.py"]
    first, second = patch.files[0].hunks
    assert (first.old_start, first.old, first.new) == (
        3, ["line 3\n", "line 4\n", "line 5\n"], ["line 3\n", "line 4\n", "inserted\n", "line 5\n"])
    assert (second.old_start, second.old, second.new) == (
        10, ["line 10\n", "line 11\n", "line 12\n"], ["line 10\n", "LINE 11\n", "line 12\n"])


def test_parse_git_extended_headers_and_several_files() -> None:
    text = (
        "diff --git a/src/lightning/a.py b/src/lightning/a.py\nindex 1111111..2222222 100644\n"
        "--- a/src/lightning/a.py\n+++ b/src/lightning/a.py\n@@ -1 +1 @@\n-a\n+A\n"
        "diff --git a/src/lightning/b.py b/src/lightning/b.py\nindex 3333333..4444444 100644\n"
        "--- a/src/lightning/b.py\t2026-01-01 00:00:00\n+++ b/src/lightning/b.py\t2026-01-01 00:00:00\n"
        "@@ -1,2 +1,2 @@\n b\n-c\n+C\n"
    )
    patch = parse("two.patch", text)
    assert patch.header == ""
    assert [f.path for f in patch.files] == ["src/lightning/a.py", "src/lightning/b.py"]
    assert apply_file(patch, patch.files[0], "a\n") == "A\n"
    assert apply_file(patch, patch.files[1], "b\nc\n") == "b\nC\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("--- /dev/null\n+++ b/src/lightning/new.py\n@@ -0,0 +1 @@\n+x\n", "only modify upstream files"),
        ("--- a/src/lightning/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n", "only modify upstream files"),
        ("--- a/src/lightning/a.py\n+++ b/src/lightning/b.py\n@@ -1 +1 @@\n-x\n+y\n", "only modify upstream files"),
        ("diff --git a/src/a.py b/src/a.py\nnew file mode 100644\n", "new file mode"),
        ("diff --git a/src/a.py b/src/a.py\ndeleted file mode 100644\n", "deleted file mode"),
        ("diff --git a/src/a.py b/src/b.py\nsimilarity index 90%\nrename from src/a.py\n", "similarity index"),
        ("--- a/src/lightning/a.py\n@@ -1 +1 @@\n-x\n+y\n", "'---' without a following '+++'"),
        ("--- a/src/lightning/a.py\n+++ b/src/lightning/a.py\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n", "is truncated"),
        ("--- a/src/lightning/a.py\n+++ b/src/lightning/a.py\n@@ -1,2 +1,2 @@\n a\n*b\n", "bad line"),
        ("--- a/src/lightning/a.py\n+++ b/src/lightning/a.py\nnot a hunk\n", "unexpected"),
        ("just words, no diff\n", "no diff found"),
    ],
)
def test_parse_refuses(text: str, message: str) -> None:
    with pytest.raises(PatchError, match="patch broken.patch") as err:
        parse("broken.patch", text)
    assert message in str(err.value)


# --- applying ---------------------------------------------------------------------------------------------------------


def test_apply_at_the_stated_lines() -> None:
    lines = _apply(_numbered(20), SIMPLE).splitlines()
    assert lines[:6] == ["line 1", "line 2", "line 3", "line 4", "inserted", "line 5"]
    assert lines[10:13] == ["line 10", "LINE 11", "line 12"]
    assert len(lines) == 21


@pytest.mark.parametrize("shift", [5, -2])
def test_apply_with_an_offset(shift: int) -> None:
    """The file gained (or lost) lines above the hunks since the patch was made: hunks apply where they now are."""
    base = _numbered(20)
    if shift > 0:
        moved = "".join(f"new top {i}\n" for i in range(shift)) + base
    else:
        moved = base.split("\n", -shift)[-1]  # drop the first lines, which no hunk touches
    out = _apply(moved, SIMPLE)
    assert out == moved.replace("line 4\n", "line 4\ninserted\n").replace("line 11\n", "LINE 11\n")


def test_a_hunk_that_does_not_match_fails_naming_patch_file_and_hunk() -> None:
    text = _numbered(20).replace("line 11\n", "line eleven\n")
    with pytest.raises(PatchError) as err:
        _apply(text, SIMPLE, name="0002-clip.patch")
    message = str(err.value)
    assert "patch 0002-clip.patch does not apply to src/lightning/x.py" in message
    assert "hunk #2 (@@ -10,3 +11,3 @@)" in message


def test_no_fuzz_whitespace_counts() -> None:
    with pytest.raises(PatchError):
        _apply(_numbered(20).replace("line 4\n", "line 4 \n"), SIMPLE)


def test_hunks_may_not_overlap_or_go_backwards() -> None:
    """A second hunk whose context exists only above the first one's result does not apply."""
    text = (
        "--- a/src/lightning/x.py\n+++ b/src/lightning/x.py\n"
        "@@ -10,2 +10,2 @@\n line 10\n-line 11\n+LINE 11\n"
        "@@ -12,2 +12,2 @@\n line 2\n-line 3\n+LINE 3\n"
    )
    with pytest.raises(PatchError, match="hunk #2"):
        _apply(_numbered(20), text)


@pytest.mark.parametrize(
    ("old", "new", "diff"),
    [
        # the patch removes the final newline
        ("a\nb\n", "a\nB", "@@ -1,2 +1,2 @@\n a\n-b\n+B\n\\ No newline at end of file\n"),
        # the patch adds one
        ("a\nb", "a\nb\n", "@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+b\n"),
        # neither has one; a context line is the one without
        ("a\nb\nc", "A\nb\nc", "@@ -1,3 +1,3 @@\n-a\n+A\n b\n c\n\\ No newline at end of file\n"),
    ],
)
def test_no_newline_at_end_of_file(old: str, new: str, diff: str) -> None:
    text = f"--- a/src/lightning/x.py\n+++ b/src/lightning/x.py\n{diff}"
    assert _apply(old, text) == new
    # the marker belongs to the line: the same file with the other ending does not match
    with pytest.raises(PatchError):
        _apply(old[:-1] if old.endswith("\n") else old + "\n", text)


def test_apply_series_in_order_all_or_nothing(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-first.patch").write_text(SIMPLE)
    (patches / "0002-second.patch").write_text(
        "--- a/src/lightning/x.py\n+++ b/src/lightning/x.py\n@@ -1,2 +1,2 @@\n-line 1\n+LINE 1\n line 2\n"
    )
    (patches / "0003-third.patch").write_text(
        "Applies on top of 0001: its context has the line 0001 inserted.\n"
        "--- a/src/lightning/x.py\n+++ b/src/lightning/x.py\n@@ -4,2 +4,2 @@\n line 4\n-inserted\n+INSERTED\n"
    )
    (patches / "series").write_text("# the order matters\n0001-first.patch\n\n0002-second.patch  # a comment\n"
                                    "0003-third.patch\n")
    files = {"lightning/x.py": _numbered(20).encode(), "lightning/y.py": b"untouched\n"}
    applied = apply_series(patches, files)
    assert [p.name for p in applied] == ["0001-first.patch", "0002-second.patch", "0003-third.patch"]
    assert files["lightning/x.py"].decode() == (
        _numbered(20).replace("line 1\n", "LINE 1\n", 1).replace("line 4\n", "line 4\nINSERTED\n")
        .replace("line 11\n", "LINE 11\n")
    )
    assert files["lightning/y.py"] == b"untouched\n"

    # a fourth patch that fails leaves every file as it was, including those the first three changed
    (patches / "0004-broken.patch").write_text(
        "--- a/src/lightning/y.py\n+++ b/src/lightning/y.py\n@@ -1 +1 @@\n-something else\n+x\n"
    )
    (patches / "series").write_text("0001-first.patch\n0002-second.patch\n0003-third.patch\n0004-broken.patch\n")
    pristine = {"lightning/x.py": _numbered(20).encode(), "lightning/y.py": b"untouched\n"}
    files = dict(pristine)
    with pytest.raises(PatchError, match="patch 0004-broken.patch does not apply to src/lightning/y.py"):
        apply_series(patches, files)
    assert files == pristine


@pytest.mark.parametrize(
    ("series", "patch", "message"),
    [
        ("0001-missing.patch\n", None, "lists 0001-missing.patch, which does not exist"),
        ("0001-a.patch\n", "--- a/docs/x.rst\n+++ b/docs/x.rst\n@@ -1 +1 @@\n-a\n+b\n", "is outside src/"),
        ("0001-a.patch\n", "--- a/src/lightning/nope.py\n+++ b/src/lightning/nope.py\n@@ -1 +1 @@\n-a\n+b\n",
         "does not apply to src/lightning/nope.py: no such upstream file"),
    ],
)
def test_apply_series_refuses(tmp_path: Path, series: str, patch: str | None, message: str) -> None:
    (tmp_path / "series").write_text(series)
    if patch is not None:
        (tmp_path / "0001-a.patch").write_text(patch)
    with pytest.raises(PatchError) as err:
        apply_series(tmp_path, {"lightning/x.py": b"a\n"})
    assert message in str(err.value)


def test_no_series_means_no_patches(tmp_path: Path) -> None:
    assert read_series(tmp_path) == []
    files = {"lightning/x.py": b"a\n"}
    assert apply_series(tmp_path, files) == []
    assert files == {"lightning/x.py": b"a\n"}


# --- agreement with git -----------------------------------------------------------------------------------------------


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run([GIT, "-c", "core.autocrlf=false", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           *args], cwd=cwd, capture_output=True)  # bytes: text mode would turn CRLF into LF
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout.decode()


def _git_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    _git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(text.encode())
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "base")
    return path


def _git_diff(tmp: Path, name: str, old: str, new: str, *options: str) -> str:
    """The diff ``git diff`` writes for OLD -> NEW of src/NAME."""
    repo = _git_repo(tmp / "diff", {f"src/{name}": old})
    (repo / "src" / name).write_bytes(new.encode())
    return _git(repo, "diff", "--no-color", *options)


def _git_apply(tmp: Path, name: str, base: str, diff: str, *options: str) -> str:
    repo = _git_repo(tmp / "apply", {f"src/{name}": base})
    (tmp / "the.patch").write_bytes(diff.encode())
    _git(repo, "apply", *options, str(tmp / "the.patch"))
    return (repo / "src" / name).read_bytes().decode()


def _edit(text: str, seed: int, ends: bool = True) -> str:
    """A deterministic, scattered set of edits: replaced, inserted and deleted lines; with ``ends``, also the first line
    and a line appended at the end."""
    rng = random.Random(seed)
    lines = text.splitlines(keepends=True)
    for at in sorted(rng.sample(range(5, len(lines) - 5), 12), reverse=True):
        kind = rng.choice(["replace", "insert", "delete"])
        if kind == "replace":
            lines[at] = lines[at].rstrip("\n") + "  # changed\n"
        elif kind == "insert":
            lines[at:at] = [f"    # inserted {at}.{k}\n" for k in range(rng.randint(1, 4))]
        else:
            del lines[at : at + rng.randint(1, 3)]
    if ends:
        lines[0] = "# edited first line\n"
        lines.append("# appended last line\n")
    return "".join(lines)


def _largest_modules(upstream_files: dict[str, bytes], n: int) -> list[str]:
    modules = [k for k in upstream_files if k.startswith("lightning/") and k.endswith(".py")]
    return sorted(modules, key=lambda k: len(upstream_files[k]), reverse=True)[:n]


@needs_git
@pytest.mark.parametrize("context", [3, 1, 0])
def test_agrees_with_git_apply_on_a_real_upstream_diff(
    tmp_path: Path, upstream_files: dict[str, bytes], context: int
) -> None:
    for seed, name in enumerate(_largest_modules(upstream_files, 2)):
        old = upstream_files[name].decode()
        new = _edit(old, seed)
        diff = _git_diff(tmp_path / f"{seed}", name, old, new, f"-U{context}")
        assert diff.count("\n@@ ") >= 5 and f"--- a/src/{name}\n" in diff
        options = ("--unidiff-zero",) if context == 0 else ()
        ours = _apply(old, "Header: a generated patch.\n\n" + diff)
        assert ours == new
        assert ours == _git_apply(tmp_path / f"{seed}", name, old, diff, *options)


@needs_git
@pytest.mark.parametrize("context", [3, 1])
def test_agrees_with_git_apply_when_the_file_has_moved(
    tmp_path: Path, upstream_files: dict[str, bytes], context: int
) -> None:
    """The patch was made against the file; it is applied to the file with lines added at the top and at the end.

    (Hunks at the very start or end of a file are left out: git anchors those there, this applier does not.)"""
    name = _largest_modules(upstream_files, 1)[0]
    old = upstream_files[name].decode()
    diff = _git_diff(tmp_path, name, old, _edit(old, 7, ends=False), f"-U{context}")
    moved = "".join(f"# a new line {i} at the top\n" for i in range(9)) + old + "# and one at the end\n"
    ours = _apply(moved, diff)
    assert ours == _git_apply(tmp_path, name, moved, diff)
    assert ours.startswith("# a new line 0 at the top\n") and ours.endswith("# and one at the end\n")


@needs_git
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("a\nb\nc\nd\n", "a\nb\nc\nD"),  # the final newline goes
        ("a\nb\nc\nd", "a\nb\nc\nd\ne\n"),  # a final newline comes
        ("a\nb\nc\nd", "a\nB\nc\nd"),  # neither has one; the last line is context
        ("a\r\nb\r\nc\r\nd\r\n", "a\r\nB\r\nc\r\nd\r\n"),  # CRLF line ends
        ("a\nb\x0cc\nd\x1ce\nf\u2028g\nh\n", "a\nb\x0cc\nd\x1ce\nF\u2028G\nh\n"),  # separators that are not newlines
    ],
    ids=["drop-final-newline", "add-final-newline", "no-final-newline", "crlf", "form-feed-and-unicode-separators"],
)
def test_agrees_with_git_apply_on_line_endings(tmp_path: Path, old: str, new: str) -> None:
    name = "lightning/edge.py"
    diff = _git_diff(tmp_path, name, old, new)
    assert _apply(old, diff) == new == _git_apply(tmp_path, name, old, diff)


@needs_git
@pytest.mark.parametrize("change", ["add", "delete", "rename"])
def test_git_diffs_that_add_delete_or_rename_files_are_refused(tmp_path: Path, change: str) -> None:
    repo = _git_repo(tmp_path / "r", {"src/lightning/a.py": _numbered(30)})
    if change == "add":
        (repo / "src/lightning/b.py").write_text("new module\n")
    elif change == "delete":
        (repo / "src/lightning/a.py").unlink()
    else:
        (repo / "src/lightning/a.py").rename(repo / "src/lightning/b.py")
    _git(repo, "add", "-A")
    diff = _git(repo, "diff", "--cached", "-M")
    with pytest.raises(PatchError, match="patches may only modify upstream files"):
        parse("0001-change.patch", diff)


def test_apply_series_keeps_crlf_in_patch_files(tmp_path: Path) -> None:
    """Patch files are read as bytes: reading them as text would turn their CRLF lines into LF and break the match."""
    (tmp_path / "0001-crlf.patch").write_bytes(
        b"--- a/src/lightning/x.py\n+++ b/src/lightning/x.py\n@@ -1,2 +1,2 @@\n a\r\n-b\r\n+B\r\n"
    )
    (tmp_path / "series").write_text("0001-crlf.patch\n")
    files = {"lightning/x.py": b"a\r\nb\r\n"}
    apply_series(tmp_path, files)
    assert files == {"lightning/x.py": b"a\r\nB\r\n"}
