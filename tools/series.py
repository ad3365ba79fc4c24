"""What make_pr.py and upstream_test.py share: the two patch series, their headers, and git.

Standard library only. Two series are read from this repository:

``patches/``                   the fork's patches to upstream's package (``a/src/lightning/...``), the build's series,
                               in two layers (shared/DESIGN.md, "Two layers"): the **forwarded** patches first, each one
                               pull request of ``stack/`` (``Forwarded: tools/upstream/stack/<NN>-<slug> ...``), then the
                               **fork-only** ones (``Forwarded: awaiting RFC tools/upstream/rfcs/<NN>-<slug>.md``,
                               ``awaiting an issue`` or ``not-needed``), which may replace a forwarded patch's lines when
                               their ``Replaces:`` field names it
``tools/upstream/test-patches/``  edits to upstream's *tests* that pin the behaviour our patches change on purpose
                               (``a/tests/...``); upstream test code may not live in our ``tests/``, so these travel as
                               patches, applied only to an upstream checkout (the PR branch, the upstream-test run)

Both use a ``series`` file (one patch file name a line, ``#`` comments) and DEP-3-like headers. Besides, a series
patch's ``Adds:`` field names our own files that come with its concern (``fork-only`` lists those that stay in the
fork), a test patch's ``Accompanies:`` field the series patch it follows, and ``resolutions/<base>/`` holds recorded
resolutions: series patches as they apply to another upstream base (``master``), checked by check_series.py.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SOURCE_PATCHES = REPO / "patches"
TEST_PATCHES = HERE / "test-patches"
RESOLUTIONS = HERE / "resolutions"
FORK_ONLY = HERE / "fork-only"

_FIELD = re.compile(r"^([A-Z][A-Za-z-]*):\s?(.*)$")
_TARGET = re.compile(r"^\+\+\+ b/(\S+)")


class Failure(Exception):
    """A step failed; the message says what and where, for a person to act on."""


@dataclass
class SeriesPatch:
    path: Path
    header: str  # everything before the diff

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def stem(self) -> str:
        return self.name[: -len(".patch")] if self.name.endswith(".patch") else self.name

    def fields(self) -> dict[str, str]:
        """DEP-3 fields; continuation lines (starting with a space) are joined to their field with newlines."""
        out: dict[str, str] = {}
        key = None
        for line in self.header.splitlines():
            if line.startswith(" ") and key is not None:
                out[key] += "\n" + line[1:]
                continue
            match = _FIELD.match(line)
            if match:
                key = match.group(1)
                out[key] = match.group(2)
            elif line.strip():
                key = None
        return out

    def commit_message(self) -> str:
        """The header as a git commit message: the description's first line as subject, the rest as body, the other
        fields (Bug, Forwarded, Author, ...) as trailers, and the patch's file name."""
        fields = self.fields()
        description = fields.pop("Description", "").strip("\n") or self.stem
        subject, _, body = description.partition("\n")
        lines = [subject.strip(), ""]
        if body.strip():
            lines += [ln.rstrip() if ln.strip() != "." else "" for ln in body.splitlines()] + [""]
        fields.pop("Adds", None)  # the commit holds those files; the list belongs to the series, not the history
        lines += [f"{key}: {value}" for key, value in fields.items()]
        lines.append(f"Patch: {self.name}")
        return "\n".join(lines).strip() + "\n"

    def adds(self) -> list[str]:
        """Our own files that come with this patch's concern (its ``Adds:`` field, one repository path a line)."""
        return self.fields().get("Adds", "").split()

    def layer(self) -> str:
        """``fork-only`` when its ``Forwarded:`` says ``not-needed`` or ``awaiting ...`` (an RFC, an issue), else
        ``forwarded`` (``Forwarded: tools/upstream/stack/<NN>-<slug> ...``, the PR it is proposed upstream as, or
        ``not yet``). The series holds the forwarded layer first, then the fork-only one."""
        value = self.fields().get("Forwarded", "").strip()
        return "fork-only" if value.startswith(("not-needed", "awaiting ")) else "forwarded"

    def stack_folder(self) -> str | None:
        """For a forwarded patch: the folder of ``tools/upstream/stack/`` it is proposed upstream as, or None."""
        words = self.fields().get("Forwarded", "").split()
        return words[0].rstrip("/") if words and words[0].startswith("tools/upstream/stack/") else None

    def rfcs(self) -> list[str]:
        """For a fork-only patch awaiting RFCs: the RFC drafts it names (``tools/upstream/rfcs/<NN>-<slug>.md``)."""
        value = self.fields().get("Forwarded", "")
        if not value.startswith("awaiting RFC"):
            return []
        return re.findall(r"tools/upstream/rfcs/[\w.-]+\.md", value.split("(", 1)[0])

    def _names(self, field: str) -> list[str]:
        value = self.fields().get(field, "").split("(", 1)[0]
        return [word for word in value.split() if word.endswith(".patch")]

    def replaces(self) -> list[str]:
        """The forwarded patches whose lines this fork-only patch replaces (``Replaces: <name>.patch ... (why)``)."""
        return self._names("Replaces")

    def stacked_on(self) -> list[str]:
        """The earlier forwarded patches this one sits on in the series, where its PR does not on master alone
        (``Stacked-On: <name>.patch ...``)."""
        return self._names("Stacked-On")

    def accompanies(self) -> str | None:
        """For an upstream test patch: the stem of the series patch whose behaviour change it follows, or None."""
        value = self.fields().get("Accompanies", "").split()
        return None if not value or value[0].lower().rstrip(":,") == "none" else value[0]

    def targets(self) -> list[str]:
        """The repository paths the patch changes, in order."""
        seen: list[str] = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            match = _TARGET.match(line)
            if match and match.group(1) not in seen:
                seen.append(match.group(1))
        return seen


def read_series(folder: Path) -> list[SeriesPatch]:
    series = folder / "series"
    if not series.is_file():
        return []
    patches = []
    for raw in series.read_text(encoding="utf-8").splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        path = folder / name
        if not path.is_file():
            raise Failure(f"{series} lists {name}, which does not exist")
        patches.append(read_patch(path))
    return patches


def read_patch(path: Path) -> SeriesPatch:
    text = path.read_text(encoding="utf-8")
    header = re.split(r"^(?:diff --git |--- )", text, maxsplit=1, flags=re.M)[0]
    return SeriesPatch(path, header)


def resolutions(folder: Path = RESOLUTIONS) -> dict[str, dict[str, SeriesPatch]]:
    """Recorded resolutions: base name (``master``) -> series patch name -> that patch as it applies there."""
    if not folder.is_dir():
        return {}
    return {d.name: {p.name: read_patch(p) for p in sorted(d.glob("*.patch"))} for d in sorted(folder.iterdir())
            if d.is_dir()}


def test_resolutions(folder: Path = RESOLUTIONS) -> dict[str, dict[str, SeriesPatch]]:
    """Base name -> test patch name -> that test patch as it applies there (``resolutions/<base>/test-patches/``):
    either a test patch of ours recorded for that base (same name), or a test patch only that base needs, for a test
    that only it has (a new name; its ``Accompanies:`` field says which patch of the series it follows)."""
    if not folder.is_dir():
        return {}
    return {d.name: {p.name: read_patch(p) for p in sorted((d / "test-patches").glob("*.patch"))}
            for d in sorted(folder.iterdir()) if d.is_dir()}


def fork_only(path: Path = FORK_ONLY) -> dict[str, str]:
    """Our files that stay in the fork (``path  # why`` lines): neither claimed by a patch nor sent upstream."""
    listed = {}
    for raw in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        name, _, why = raw.partition("#")
        if name.strip():
            listed[name.strip()] = why.strip()
    return listed


def unclaimed(names: list[str], patches: list[SeriesPatch]) -> list[str]:
    """Of our files ``names``, those no patch's ``Adds:`` names and ``fork-only`` does not list."""
    claimed = {path for patch in patches for path in patch.adds()} | set(fork_only())
    return sorted(name for name in names if name not in claimed)


def git(cwd: Path, *args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, env=env)
    if check and done.returncode != 0:
        raise Failure(f"`git {' '.join(args)}` failed in {cwd}:\n{done.stderr.strip() or done.stdout.strip()}")
    return done


def conflicts(checkout: Path, patch: SeriesPatch) -> list[str]:
    """Why ``patch`` does not apply to the checkout's index, file by file (git's own words); [] if it applies."""
    whole = git(checkout, "apply", "--check", "--index", str(patch.path), check=False)
    if whole.returncode == 0:
        return []
    reasons = []
    for target in patch.targets():
        one = git(checkout, "apply", "--check", "--index", f"--include={target}", str(patch.path), check=False)
        if one.returncode != 0:
            detail = "; ".join(ln.removeprefix("error: ") for ln in one.stderr.strip().splitlines())
            reasons.append(f"{target}: {detail}")
    return reasons or [whole.stderr.strip()]
