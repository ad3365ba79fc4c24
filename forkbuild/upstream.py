"""Obtaining the pinned upstream wheel and proving it is the one we pinned.

Two sources, in this order:

1. A local file, for offline builds: the PEP 517 config setting ``upstream-wheel`` (``pip install .
   --config-settings upstream-wheel=PATH``) or the environment variable ``LIGHTNING_FORK_UPSTREAM_WHEEL``. PATH is the
   wheel itself or a folder that holds it.
2. Otherwise the user's own package index, through ``pip download``, so that pip's configuration (``PIP_INDEX_URL``,
   ``PIP_EXTRA_INDEX_URL``, ``PIP_FIND_LINKS``, pip.conf) decides where it comes from. No host is hard-coded.

Either way the file's sha256 must equal the pin's: pip's ``--require-hashes`` does not cover build inputs, so the
build checks it itself.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from forkbuild.pin import BuildError, Pin

CONFIG_SETTING = "upstream-wheel"
ENV_VAR = "LIGHTNING_FORK_UPSTREAM_WHEEL"
# uv's index settings, passed on to pip when pip's own are unset, so `uv pip install git+...` uses the same index
_UV_TO_PIP = {
    "UV_DEFAULT_INDEX": "PIP_INDEX_URL",
    "UV_INDEX_URL": "PIP_INDEX_URL",
    "UV_EXTRA_INDEX_URL": "PIP_EXTRA_INDEX_URL",
    "UV_FIND_LINKS": "PIP_FIND_LINKS",
}


def local_source(config_settings: Optional[Mapping[str, Any]] = None) -> Optional[Path]:
    """The local upstream wheel (or folder) the user asked for, if any."""
    value = (config_settings or {}).get(CONFIG_SETTING) or os.environ.get(ENV_VAR)
    return Path(os.path.expanduser(str(value))) if value else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(pin: Pin, wheel: Path) -> Path:
    """Refuse any file whose sha256 is not the pinned one."""
    actual = sha256_of(wheel)
    if actual != pin.sha256:
        raise BuildError(
            f"the upstream wheel {wheel} does not match the pin in {pin.path.name}:\n"
            f"  expected sha256 {pin.sha256}\n"
            f"  actual sha256   {actual}\n"
            f"It is not the official {pin.filename}. Get that file again (from PyPI or your index) and retry;"
            f" do not edit the pin to make the build pass."
        )
    return wheel


def _from_local(pin: Pin, source: Path) -> Path:
    """The wheel at ``source``, or in the folder ``source``. Given another file of the same folder (the other
    distribution's wheel: one setting serves both builds), the pinned file beside it."""
    if source.is_dir():
        wheel = source / pin.filename
    elif source.name != pin.filename and (source.parent / pin.filename).is_file():
        wheel = source.parent / pin.filename
    else:
        wheel = source
    if not wheel.is_file():
        where = f"folder {source}" if source.is_dir() else f"path {source}"
        raise BuildError(
            f"the upstream wheel was asked for at {where} ({CONFIG_SETTING} / {ENV_VAR}) but {wheel} does not exist;"
            f" download it with `pip download {pin.requirement} --no-deps --only-binary=:all: -d FOLDER`"
        )
    return wheel


def _download(pin: Pin, folder: Path) -> Path:
    env = dict(os.environ)
    for uv_name, pip_name in _UV_TO_PIP.items():
        if env.get(uv_name) and not env.get(pip_name):
            env[pip_name] = env[uv_name]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    command += ["--dest", str(folder), pin.requirement]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    except OSError as err:
        raise BuildError(f"could not run pip to download {pin.requirement}: {err}") from err
    if done.returncode != 0:
        raise BuildError(
            f"`pip download {pin.requirement}` failed (exit {done.returncode}); pip said:\n{done.stderr.strip()}\n"
            f"Offline? Point {ENV_VAR} (or --config-settings {CONFIG_SETTING}=PATH) at a copy of {pin.filename}."
        )
    wheel = folder / pin.filename
    if not wheel.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise BuildError(f"`pip download {pin.requirement}` gave {found}, not {pin.filename}")
    return wheel


def obtain(pin: Pin, folder: Path, config_settings: Optional[Mapping[str, Any]] = None) -> Path:
    """Return the path of the verified upstream wheel, downloading it into ``folder`` when no local copy is given."""
    source = local_source(config_settings)
    wheel = _from_local(pin, source) if source is not None else _download(pin, folder)
    return verify(pin, wheel)
