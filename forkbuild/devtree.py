"""The patched upstream tree as a git history, and back into the patch series.

``python -m forkbuild tree`` materialises ``.tree/`` (ignored by git) in upstream's repository layout::

    upstream   lightning 2.6.6, exactly the pinned wheel's package (tag ``upstream``)
    overlay    our own modules from src/ (tag ``overlay``)
    <patch>    one commit per patch of patches/series, the patch's header as the commit message

Edit and test there (``PYTHONPATH=.tree/src``), committing each change into the commit of the patch it belongs to
(``git commit --fixup`` + ``git rebase -i --autosquash overlay``) or as a new commit (a new patch: the subject line
is its file name, the body its header). ``python -m forkbuild export`` then writes every commit after ``overlay``
back as patches/<subject>.patch and rewrites patches/series; files that upstream does not have are our modules and
go back to src/. Nobody edits diff files by hand.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from typing import Optional

from forkbuild import assemble, stamp, upstream
from forkbuild.patching import Patch, apply_file, parse, read_series
from forkbuild.pin import ROOT, STANDALONE, BuildError, read_pin

TREE = ROOT / ".tree"
_IDENTITY = ["-c", "user.name=forkbuild", "-c", "user.email=forkbuild@localhost", "-c", "commit.gpgsign=false"]


def _git(tree: Path, *args: str, capture: bool = True) -> str:
    done = subprocess.run(["git", *_IDENTITY, "-C", str(tree), *args], capture_output=capture, text=True)
    if done.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {tree}:\n{done.stderr}")
    return done.stdout if capture else ""


def _commit(tree: Path, message: str) -> None:
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "--allow-empty", "-m", message)


def materialise(tree: Path = TREE, force: bool = False, upstream_wheel: Optional[Path] = None) -> Path:
    """Write upstream + overlay + one commit per patch into ``tree`` as a fresh git repository.

    The overlay commit also sets ``lightning/version.info`` to the fork's version (as the wheel does), so that an
    editable install (forkbuild/editable.py) reports ``2.6.6+amp.1``."""
    if tree.exists():
        if not force:
            raise BuildError(f"{tree} exists; pass --force to replace it (uncommitted work there is lost)")
        shutil.rmtree(tree)
    pin = read_pin()
    src = tree / "src"
    with tempfile.TemporaryDirectory() as tmp:
        wheel = upstream_wheel if upstream_wheel is not None else upstream.obtain(pin, Path(tmp))
        upstream.verify(pin, wheel)
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if not info.is_dir() and not info.filename.split("/", 1)[0].endswith(".dist-info"):
                    target = src / info.filename
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(info))
    _git(tree.parent, "init", "-q", "-b", "main", str(tree))
    (tree / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    _commit(tree, f"upstream: {pin.filename} (sha256 {pin.sha256})")
    _git(tree, "tag", "upstream")
    for name, data in assemble.overlay_files().items():
        target = src / name
        if target.exists():
            raise BuildError(f"src/{name} would overwrite an upstream file; change it with a patch instead")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (src / "lightning" / "version.info").write_text(pin.fork_version + "\n", encoding="ascii")
    _commit(tree, "overlay: the fork's own modules (src/) and its version (lightning/version.info)")
    _git(tree, "tag", "overlay")
    for path in read_series(assemble.PATCHES):
        patch = parse(path.name, path.read_text(encoding="utf-8"))
        for file_patch in patch.files:
            target = tree / file_patch.path
            if not target.is_file():
                raise BuildError(f"patch {patch.name}: {file_patch.path} is not an upstream file")
            target.write_text(apply_file(patch, file_patch, target.read_text(encoding="utf-8")), encoding="utf-8")
        stem = path.name[: -len(".patch")] if path.name.endswith(".patch") else path.name
        _commit(tree, f"{stem}\n\n{patch.header.strip()}\n")
    stamp.write(tree, ROOT)
    return tree


def matches_inputs(tree: Path, upstream_wheel: Path) -> bool:
    """Whether ``tree/src`` holds exactly the package that the checkout's inputs build (its working files)."""
    pin = read_pin()
    built = assemble.fork_files(pin, upstream_wheel)
    package = {k: v for k, v in built.items() if not k.split("/", 1)[0].endswith(".dist-info")}
    src = tree / "src"
    if not src.is_dir():
        return False
    present = {
        p.relative_to(src).as_posix(): p for p in src.rglob("*")
        if p.is_file() and not any(part == "__pycache__" or part.endswith((".pyc", ".pyo")) for part in
                                   p.relative_to(src).parts)
    }
    return present.keys() == package.keys() and all(present[k].read_bytes() == v for k, v in package.items())


def export(tree: Path = TREE) -> list[str]:
    """Write the tree's commits after ``overlay`` back into patches/ and its new files back into src/."""
    if not (tree / ".git").exists():
        raise BuildError(f"{tree} is not a materialised tree; run `python -m forkbuild tree` first")
    if _git(tree, "status", "--porcelain").strip():
        raise BuildError(f"{tree} has uncommitted changes; commit them (into the patch they belong to) first")
    upstream_files = set(_git(tree, "ls-tree", "-r", "--name-only", "upstream").splitlines())
    head_files = set(_git(tree, "ls-tree", "-r", "--name-only", "HEAD").splitlines())
    ours = sorted(f for f in head_files - upstream_files if f.startswith("src/"))
    commits = _git(tree, "rev-list", "--reverse", "overlay..HEAD").split()
    written: list[str] = []
    patch_texts: dict[str, str] = {}
    for commit in commits:
        subject = _git(tree, "log", "-1", "--format=%s", commit).strip()
        body = _git(tree, "log", "-1", "--format=%b", commit).strip()
        name = subject if subject.endswith(".patch") else f"{subject}.patch"
        if "/" in name or name in patch_texts:
            raise BuildError(f"commit {commit[:10]}: subject {subject!r} must be a unique file name for its patch")
        changed = _git(tree, "diff", "--name-only", "--no-renames", f"{commit}^", commit).split()
        upstream_paths = [p for p in changed if p in upstream_files]
        if not upstream_paths:
            continue  # a commit that only touches our own modules: they go back to src/ below
        diff = _git(tree, "diff", "--no-color", "--no-renames", "--full-index", f"{commit}^", commit, "--", *upstream_paths)
        patch_texts[name] = f"{body}\n\n{diff}"
    for stale in read_series(assemble.PATCHES):
        if stale.name not in patch_texts:
            stale.unlink()
    for name, text in patch_texts.items():
        (assemble.PATCHES / name).write_text(text, encoding="utf-8")
        written.append(name)
    (assemble.PATCHES / "series").write_text(series_text(patch_texts), encoding="utf-8")
    overlay_root = assemble.OVERLAY
    for name in ours:
        target = overlay_root / name[len("src/") :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((tree / name).read_bytes())
    stamp.write(tree, ROOT)  # the inputs now say what the tree says
    return written


#: the comment that opens patches/series
SERIES_COMMENT = (
    "# The series the wheel ships, in order: each patch one concern, written once where it ends up. Its DEP-3\n"
    "# `Forwarded:` says where the concern went upstream: a PR of upstream/stack/, an RFC of upstream/rfcs/, `no` (not\n"
    "# yet) or `not-needed`.\n"
)


def series_text(patch_texts: dict[str, str]) -> str:
    """patches/series: the comment, then the names in order."""
    return SERIES_COMMENT + "".join(f"{name}\n" for name in patch_texts)


def tree_inputs(tree: Path = TREE) -> tuple[list[Patch], dict[str, bytes]]:
    """The tree's working files, committed or not, as build inputs in lightning's layout: one patch holding every
    change to upstream's files (against the ``upstream`` tag), and the files upstream does not have (our modules)."""
    if not (tree / ".git").is_dir():
        raise BuildError(f"{tree} is not a materialised tree; run `make tree` first")
    upstream_files = set(_git(tree, "ls-tree", "-r", "--name-only", "upstream", "--", "src").splitlines())
    present = {
        p.relative_to(tree).as_posix() for p in (tree / "src").rglob("*")
        if p.is_file() and not any(part == "__pycache__" or part.endswith((".pyc", ".pyo")) for part in p.parts)
    }
    changed = _git(tree, "diff", "--name-only", "--no-renames", "--diff-filter=M", "upstream", "--", "src").split()
    patches = []
    if changed:
        diff = _git(tree, "diff", "--no-color", "--no-renames", "--full-index", "upstream", "--", *changed)
        patches.append(parse(f"{tree.name}-working-files", f"The working files of {tree}.\n\n{diff}"))
    overlay = {name[len("src/"):]: (tree / name).read_bytes() for name in sorted(present - upstream_files)}
    return patches, overlay


def standalone_wheel(out: Path, tree: Path = TREE) -> Path:
    """The standalone ``pytorch-lightning`` wheel built from the tree's working files instead of patches/ and src/:
    what ``import pytorch_lightning`` gets from edits in .tree/ before they are exported (an editable install
    imports ``lightning`` from the tree itself)."""
    flv = assemble.flavour(STANDALONE)
    pin = assemble.flavour_pin(flv)
    out.mkdir(parents=True, exist_ok=True)
    inputs = tree_inputs(tree)
    with tempfile.TemporaryDirectory() as tmp:
        return assemble.write_wheel(pin, upstream.obtain(pin, Path(tmp)), out, flv, inputs=inputs)
