"""The series as the maintainers' commands read it: patches with their DEP-3 headers, the files they claim, and git.

The series check (``python -m forkbuild series-check``) and the upstream workbench (``python -m upstream.pr_stack``,
``python -m upstream.upstream_test``) read it here; which files a series holds, and in what order, is
:func:`forkbuild.patching.read_series`'s, the build's own reader. Two series are read from this repository, each a
``series`` file (one patch file name a line, ``#`` comments) with DEP-3 headers:

``patches/``                 the fork's patches to upstream's package (``a/src/lightning/...``): what the wheel ships.
                             A patch's ``Adds:`` field names our own files that come with its concern; ``fork-only``
                             there lists our files that no patch claims (the build reads only what ``series`` names).
``upstream/test-patches/``   edits to upstream's *tests* that pin behaviour our patches change on purpose
                             (``a/tests/...``), applied only to an upstream checkout; a test patch's ``Accompanies:``
                             field names the series patch it follows.

Standard library only.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from forkbuild import patching
from forkbuild.pin import ROOT, BuildError

REPO = ROOT
SOURCE_PATCHES = REPO / "patches"
TEST_PATCHES = REPO / "upstream" / "test-patches"
FORK_ONLY = SOURCE_PATCHES / "fork-only"

_FIELD = re.compile(r"^([A-Z][A-Za-z-]*):\s?(.*)$")
_TARGET = re.compile(r"^\+\+\+ b/(\S+)")


class Failure(BuildError):
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

    def adds(self) -> list[str]:
        """Our own files that come with this patch's concern (its ``Adds:`` field, one repository path a line)."""
        return self.fields().get("Adds", "").split()

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
    """The series of ``folder`` in order, each patch with its header ([] without a ``series`` file)."""
    try:
        paths = patching.read_series(folder)
    except patching.PatchError as err:
        raise Failure(str(err)) from None
    return [SeriesPatch(path, patching.header(path.read_text(encoding="utf-8"))) for path in paths]


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


def identity_env(checkout: Path) -> dict[str, str]:
    """The checkout's git identity if it has one (a PR branch is the maintainer's), else a stated fallback."""
    env = dict(os.environ)
    if not git(checkout, "config", "user.name", check=False).stdout.strip():
        env.setdefault("GIT_AUTHOR_NAME", "lightning-amp fork")
        env.setdefault("GIT_COMMITTER_NAME", "lightning-amp fork")
    if not git(checkout, "config", "user.email", check=False).stdout.strip():
        env.setdefault("GIT_AUTHOR_EMAIL", "lightning-amp-fork@localhost")
        env.setdefault("GIT_COMMITTER_EMAIL", "lightning-amp-fork@localhost")
    return env
