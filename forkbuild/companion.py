"""One git URL installs both distributions: ``lightning``'s requirement on its companion ``pytorch-lightning``.

The fork's ``lightning`` requires exactly the patched companion (``pytorch-lightning==2.6.6+amp.1``), which no package
index has. So ``pip install git+URL`` alone would fail to find it. When pip or uv builds ``lightning`` in its own
clone of a git URL, the build knows where the companion is, the same repository at the same commit, and writes that
into the wheel's metadata as a PEP 508 direct reference::

    Requires-Dist: pytorch-lightning @ git+URL@<commit>#subdirectory=packaging/pytorch-lightning

which pip and uv follow. Everywhere else (``pip install .`` in a checkout, ``python -m forkbuild wheel``, an sdist)
the pin stays, so ``pip install . ./packaging/pytorch-lightning`` and a pair of wheel files keep working: a direct
reference there would conflict with the companion given beside it.

How an installer's clone is recognised (neither pip nor uv tells the build where its source came from):

* pip clones into a temporary folder whose ``origin`` is the URL the user gave: ``pip-req-build-*`` for a bare URL
  (``pip install git+URL``), ``pip-install-*/lightning_<hex>`` (``pip-wheel-*/...``, ``pip-download-*/...``) for a
  named one (``pip install "lightning @ git+URL@<tag>"``, the form of requirements files);
* uv checks the commit out of its own clone (``<uv cache>/git-v*/db/<id>``) into ``<uv cache>/git-v*/checkouts/...``,
  whose ``origin`` is that clone. uv fills its clone with ``git fetch <URL> ...``, and git records the URL it fetched
  from in the clone's ``FETCH_HEAD`` (without credentials): the reference names that URL, the one the user gave, so
  that ``uv.lock`` and ``uv pip freeze`` name the companion portably (a reference to uv's cache folder breaks
  ``uv sync`` on any other machine and after ``uv cache clean``). Only when ``FETCH_HEAD`` names no URL outside uv's
  cache does the reference fall back to uv's clone, which lives as long as the cached wheel.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Optional

from forkbuild.pin import STANDALONE

#: where the companion's build recipe lies in the repository
SUBDIRECTORY = f"packaging/{STANDALONE}"
_PIP_CLONE = re.compile(r"^pip-req-build-")
_PIP_NAMED_CLONE = re.compile(r"^[a-z0-9_]+_[0-9a-f]{32}$")  # <canonical name, '-' as '_'>_<uuid4 hex>
_PIP_INSTALL_DIR = re.compile(r"^pip-(install|wheel|download)-")  # the command's temporary folder
_UV_BUCKET = re.compile(r"^git-v\d+$")


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _in_uv_cache(path: Path, folder: str) -> bool:
    """Whether ``path`` lies in ``<uv cache>/git-v*/<folder>/``."""
    parts = path.parts
    return any(_UV_BUCKET.match(parts[i]) and parts[i + 1] == folder for i in range(len(parts) - 1))


def installer_clone_url(root: Path) -> Optional[str]:
    """The git URL that pip or uv cloned ``root`` from, when ``root`` is the top of such a clone; else None."""
    root = root.resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None
    origin = _git(root, "config", "--get", "remote.origin.url")
    if not origin:
        return None
    if _PIP_CLONE.match(root.name) or (_PIP_NAMED_CLONE.match(root.name) and _PIP_INSTALL_DIR.match(root.parent.name)):
        return origin
    if _in_uv_cache(root, "checkouts") and _in_uv_cache(Path(origin), "db"):
        return _fetched_from(Path(origin)) or Path(origin).resolve().as_uri()
    return None


def _fetched_from(clone: Path) -> Optional[str]:
    """The URL that uv's clone ``clone`` was last fetched from, as its ``FETCH_HEAD`` names it; None when it names
    none, or only another folder of uv's cache."""
    fetch_head = _git(clone, "rev-parse", "--git-path", "FETCH_HEAD")
    if fetch_head is None:
        return None
    path = Path(fetch_head) if Path(fetch_head).is_absolute() else clone / fetch_head
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        # "<sha>\t[not-for-merge]\t<URL>" or "<sha>\t[not-for-merge]\t<what> of <URL>" (a URL holds no spaces)
        fields = line.split("\t")
        if len(fields) < 3 or not fields[2].strip():
            continue
        url = fields[2].strip().rsplit(" of ", 1)[-1]
        local = Path(url[len("file://"):]) if url.startswith("file://") else Path(url) if "://" not in url else None
        if local is not None and (_in_uv_cache(local, "db") or _in_uv_cache(local, "checkouts")):
            continue
        return url
    return None


def _for_old_pips(url: str) -> str:
    """``file:///path`` as ``file://localhost/path``: the same for git, and pip < 24 (packaging < 22) refuses a
    ``file:`` URL without a host in a requirement (``Invalid URL``)."""
    return "file://localhost/" + url[len("file:///"):] if url.startswith("file:///") else url


def _git_url(origin: str) -> str:
    if "://" not in origin and not origin.startswith("git@"):
        origin = Path(origin).resolve().as_uri()  # a local path
    if origin.startswith("git@"):  # scp-like syntax (git@host:owner/repo) as the ssh URL pip understands
        host, _, path = origin.partition(":")
        origin = f"ssh://{host}/{path}"
    return "git+" + _for_old_pips(origin)


def direct_reference(root: Path) -> Optional[str]:
    """``pytorch-lightning @ git+URL@<commit>#subdirectory=packaging/pytorch-lightning`` when ``root`` is an
    installer's clone of URL (see the module's docstring); None otherwise."""
    origin = installer_clone_url(root)
    commit = _git(root, "rev-parse", "HEAD") if origin else None
    if not origin or not commit:
        return None
    return f"{STANDALONE} @ {_git_url(origin)}@{commit}#subdirectory={SUBDIRECTORY}"
