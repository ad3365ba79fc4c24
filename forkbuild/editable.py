"""PEP 660 editable install of ``lightning``: ``pip install -e .`` imports lightning from the patched tree .tree/src.

The editable wheel holds the fork's metadata (the same METADATA as the real wheel: version, dependencies) and a .pth
file that puts ``.tree/src`` on ``sys.path``. The tree is the one ``make tree`` materialises (upstream, our modules,
one commit per patch): edit there, ``make export`` writes the edits back into patches/ and src/.

``build_editable`` materialises .tree/ when it does not exist, and refuses (saying what to run) when it was made from
other inputs than the checkout's. After the install, every interpreter start checks the same thing
(forkbuild/stamp.py, loaded by path) and prints what to run when the tree has gone stale, e.g. after a ``git pull``
that changed patches/.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from forkbuild import assemble, devtree, stamp
from forkbuild.pin import ROOT, BuildError, Pin

MODULE = "_lightning_fork_editable"

_HOOK = '''"""Installed by `pip install -e {root}`: `lightning` is imported from {src}.

At interpreter start this checks that the tree was made from the checkout's patches/ and src/ (forkbuild/stamp.py)
and prints what to run when not."""


def _check() -> None:
    import importlib.util
    import sys
    from pathlib import Path

    root = Path({root!r})
    try:
        spec = importlib.util.spec_from_file_location("_lightning_fork_stamp", root / "forkbuild" / "stamp.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        message = module.stale_message(root)
    except Exception as err:  # the checkout moved or was removed
        message = f"cannot check {{root}}/.tree: {{err}}"
    if message:
        print(f"lightning (editable install): {{message}}", file=sys.stderr)


_check()
'''


def ensure_tree(upstream_wheel: Path, tree: Path = devtree.TREE) -> Path:
    """The materialised tree, made now if missing; a stale one is refused with what to run."""
    if not (tree / ".git").is_dir():
        if tree.exists():
            raise BuildError(f"{tree} exists but is not a materialised tree; remove it or run `make tree`")
        devtree.materialise(tree, upstream_wheel=upstream_wheel)
    if stamp.recorded(tree) is None and devtree.matches_inputs(tree, upstream_wheel):
        stamp.write(tree, ROOT)  # a tree made before stamps existed, still equal to what the inputs make
    message = stamp.stale_message(ROOT, tree)
    if message:
        raise BuildError(f"cannot make an editable install: {message}")
    return tree


def editable_files(pin: Pin, upstream_wheel: Path, tree: Path) -> dict[str, bytes]:
    files, upstream_dist_info = assemble.read_upstream(upstream_wheel)
    flv = assemble.FLAVOURS["lightning"]
    meta = {k[len(upstream_dist_info) + 1 :]: v for k, v in files.items() if k.startswith(upstream_dist_info + "/")}
    meta["METADATA"] = assemble._metadata(meta["METADATA"], pin, assemble.README.read_text(encoding="utf-8"), flv)
    src = (tree / "src").resolve()
    out = {
        f"{MODULE}.pth": f"{src}\nimport {MODULE}\n".encode("utf-8"),
        f"{MODULE}.py": _HOOK.format(root=str(ROOT), src=str(src)).encode("utf-8"),
    }
    dist_info = f"{flv.project}-{pin.fork_version}.dist-info"
    out.update({f"{dist_info}/{k}": v for k, v in sorted(meta.items())})
    record = [assemble._record_line(name, data) for name, data in out.items()] + [f"{dist_info}/RECORD,,"]
    out[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode("utf-8")
    return out


def write_editable_wheel(
    pin: Pin, upstream_wheel: Path, directory: Path, config_settings: Optional[Mapping[str, Any]] = None
) -> Path:
    import zipfile

    tree = ensure_tree(upstream_wheel)
    files = editable_files(pin, upstream_wheel, tree)
    target = Path(directory) / assemble.wheel_name(pin)
    partial = target.with_name(target.name + ".part")
    with zipfile.ZipFile(partial, "w") as z:
        for name, data in files.items():
            z.writestr(assemble._zip_info(name), data)
    os.replace(partial, target)
    return target
