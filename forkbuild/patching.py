"""The patch series: unified diffs against upstream files, applied strictly and in memory.

A patch file is a short header (why, which upstream issue, whether forwarded; in the spirit of DEP-3) followed by a
unified diff whose paths are upstream's repository paths (``src/lightning/...``), so the same file applies to an
upstream checkout with ``git apply``. Hunks must match their context exactly; a hunk may have moved (an offset), but
nothing is fuzzy. A patch that does not apply raises :class:`PatchError` naming the patch, the file and the hunk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from forkbuild.pin import BuildError

SERIES = "series"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(BuildError):
    """A patch is malformed or does not apply."""


@dataclass
class Hunk:
    header: str
    old_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    name: str
    header: str
    files: list[FilePatch]


def _lines(text: str) -> list[str]:
    """Split at "\\n" only, keeping the ends, as diff and git do (``str.splitlines`` also splits at \\f, \\x1c...)."""
    lines = text.split("\n")
    last = lines.pop()  # "" when the text ends with a newline
    return [line + "\n" for line in lines] + ([last] if last else [])


def _strip_prefix(raw: str) -> str:
    path = raw.split("\t", 1)[0].strip()
    return path[2:] if path.startswith(("a/", "b/")) else path


def header(text: str) -> str:
    """A patch file's header: every line before its diff (DEP-3 fields and prose)."""
    lines = _lines(text)
    end = next((i for i, line in enumerate(lines) if line.startswith(("--- ", "diff --git "))), len(lines))
    return "".join(lines[:end])


def parse(name: str, text: str) -> Patch:
    """Parse one patch file. Creating, deleting or renaming files is refused: new files are our own modules."""
    head = header(text)
    lines = _lines(text)
    files: list[FilePatch] = []
    i = len(_lines(head))
    while i < len(lines):
        line = lines[i]
        if line.startswith(("diff --git ", "index ")):
            i += 1
            continue
        if line.startswith(("new file mode", "deleted file mode", "rename from", "similarity index")):
            raise PatchError(f"patch {name}: line {i + 1}: patches may only modify upstream files ({line.strip()});"
                             " put new modules under src/ instead")
        if line.startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise PatchError(f"patch {name}: line {i + 1}: '---' without a following '+++'")
            old_path, new_path = _strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:])
            if old_path == "/dev/null" or new_path == "/dev/null" or old_path != new_path:
                raise PatchError(f"patch {name}: line {i + 1}: patches may only modify upstream files in place"
                                 f" ({old_path} -> {new_path}); put new modules under src/ instead")
            files.append(FilePatch(new_path))
            i += 2
            continue
        match = _HUNK.match(line)
        if match is None:
            if not line.strip():
                i += 1
                continue
            raise PatchError(f"patch {name}: line {i + 1}: unexpected {line.rstrip()!r}")
        if not files:
            raise PatchError(f"patch {name}: line {i + 1}: hunk before any file header")
        old_len = int(match.group(2)) if match.group(2) is not None else 1
        new_len = int(match.group(4)) if match.group(4) is not None else 1
        hunk = Hunk(line.strip(), int(match.group(1)))
        last = ""
        i += 1
        while len(hunk.old) < old_len or len(hunk.new) < new_len or (i < len(lines) and lines[i].startswith("\\")):
            if i >= len(lines):
                raise PatchError(f"patch {name}: {files[-1].path}: hunk {hunk.header} is truncated")
            body = lines[i]
            tag, content = body[:1], body[1:]
            if tag == "\\":  # "\ No newline at end of file": the line before it has no newline
                for side in {" ": (hunk.old, hunk.new), "-": (hunk.old,), "+": (hunk.new,)}.get(last, ()):
                    side[-1] = side[-1].rstrip("\n")
            elif tag == " " or body in ("\n", "\r\n"):
                content = content if tag == " " else body
                hunk.old.append(content)
                hunk.new.append(content)
            elif tag == "-":
                hunk.old.append(content)
            elif tag == "+":
                hunk.new.append(content)
            else:
                raise PatchError(f"patch {name}: {files[-1].path}: hunk {hunk.header}: bad line {body.rstrip()!r}")
            last = " " if body in ("\n", "\r\n") else tag
            i += 1
        files[-1].hunks.append(hunk)
    if not files:
        raise PatchError(f"patch {name}: no diff found")
    return Patch(name, head, files)


def _find(lines: list[str], block: list[str], expected: int, floor: int) -> int:
    """Index where ``block`` occurs exactly, nearest to ``expected`` and not before ``floor``; -1 if nowhere."""
    last = len(lines) - len(block)
    for distance in range(0, max(last, expected) + 1):
        for at in (expected - distance, expected + distance):
            if floor <= at <= last and lines[at : at + len(block)] == block:
                return at
    return -1


def apply_file(patch: Patch, file_patch: FilePatch, text: str) -> str:
    """Apply every hunk of ``file_patch`` to ``text``; all or nothing."""
    lines = _lines(text)
    offset = 0
    floor = 0
    for number, hunk in enumerate(file_patch.hunks, 1):
        expected = max(hunk.old_start - 1 + offset, 0) if hunk.old else hunk.old_start + offset
        at = _find(lines, hunk.old, expected, floor)
        if at < 0:
            first = next((ln for ln in hunk.old if ln.strip()), "").rstrip()
            raise PatchError(
                f"patch {patch.name} does not apply to {file_patch.path}: hunk #{number} ({hunk.header}) not found"
                f" (its context starts {first!r}); the upstream file differs from what the patch expects:"
                f" refresh the patch with `python -m forkbuild tree` and `python -m forkbuild export`"
            )
        lines[at : at + len(hunk.old)] = hunk.new
        offset += len(hunk.new) - len(hunk.old)
        floor = at + len(hunk.new)
    return "".join(lines)


def read_series(patch_dir: Path) -> list[Path]:
    """The patch files in the order ``patches/series`` gives (blank lines and ``#`` comments ignored)."""
    series = patch_dir / SERIES
    if not series.is_file():
        return []
    names = [ln.split("#", 1)[0].strip() for ln in series.read_text(encoding="utf-8").splitlines()]
    paths = []
    for name in filter(None, names):
        path = patch_dir / name
        if not path.is_file():
            raise PatchError(f"{series}: lists {name}, which does not exist")
        paths.append(path)
    return paths


def apply_patch(patch: Patch, files: dict[str, bytes], prefix: str = "src/") -> None:
    """Apply one parsed patch to ``files`` (path inside the wheel -> content), in memory, all or nothing."""
    staged = {}
    for file_patch in patch.files:
        if not file_patch.path.startswith(prefix):
            raise PatchError(f"patch {patch.name}: {file_patch.path} is outside {prefix}; only the package is built")
        key = file_patch.path[len(prefix) :]
        if key not in files and key not in staged:
            raise PatchError(f"patch {patch.name} does not apply to {file_patch.path}: no such upstream file")
        text = staged[key] if key in staged else files[key].decode("utf-8")
        staged[key] = apply_file(patch, file_patch, text)
    files.update({key: text.encode("utf-8") for key, text in staged.items()})


def apply_series(patch_dir: Path, files: dict[str, bytes], prefix: str = "src/") -> list[Patch]:
    """Apply the series to ``files`` (upstream path without ``prefix`` -> content), in memory, all or nothing.

    Patch paths carry upstream's repository prefix (``src/``); ``files`` is keyed by the path inside the wheel.
    On any failure ``files`` is left exactly as it was.
    """
    staged = dict(files)
    applied = []
    for path in read_series(patch_dir):
        patch = parse(path.name, path.read_bytes().decode("utf-8"))
        apply_patch(patch, staged, prefix)
        applied.append(patch)
    files.update(staged)
    return applied
