"""Whether the materialised tree (.tree/) was made from the build inputs the checkout holds now.

``python -m forkbuild tree`` and ``export`` record a digest of the inputs (upstream.toml, patches/, src/) in
``.tree/.git/forkbuild-inputs``; an editable install (``pip install -e .``, which imports lightning from .tree/src)
compares it with the checkout's inputs at every interpreter start and says what to run when they differ.

Standard library only and no imports from forkbuild: the editable install loads this file by its path.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

STAMP = Path(".git") / "forkbuild-inputs"
_SKIP = ("__pycache__", ".pyc", ".pyo")


def inputs_digest(root: Path) -> str:
    """sha256 over the names and contents of upstream.toml and every file under patches/ and src/."""
    digest = hashlib.sha256()
    paths = [root / "upstream.toml"]
    for folder in ("patches", "src"):
        paths += sorted(p for p in (root / folder).rglob("*") if p.is_file())
    for path in paths:
        rel = path.relative_to(root)
        if any(part in _SKIP or part.endswith(_SKIP) for part in rel.parts) or not path.is_file():
            continue
        digest.update(rel.as_posix().encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def write(tree: Path, root: Path) -> None:
    (tree / STAMP).write_text(inputs_digest(root) + "\n", encoding="ascii")


def recorded(tree: Path) -> Optional[str]:
    path = tree / STAMP
    return path.read_text(encoding="ascii").strip() if path.is_file() else None


def stale_message(root: Path, tree: Optional[Path] = None) -> Optional[str]:
    """None when ``tree`` (default ``root/.tree``) was made from, or exported to, the current inputs; else what to do."""
    tree = tree or root / ".tree"
    if not (tree / ".git").is_dir():
        return (f"{tree} does not exist (any more): run `make tree` in {root}, or reinstall"
                f" (`pip install -e {root} {root}/packaging/pytorch-lightning`)")
    if recorded(tree) == inputs_digest(root):
        return None
    return (f"{tree} is stale: patches/, src/ or upstream.toml in {root} changed since it was materialised. Run"
            f" `make tree` there to rebuild it (uncommitted or unexported work in the tree is lost), or `make export`"
            f" if the newer work is the tree's")
