"""PEP 517 build backend: what ``pip install git+<repo>``, ``uv pip install`` and ``pip install .`` call.

It needs nothing but the standard library (and pip, only to download the upstream wheel when no local copy is
given); in particular it never installs torch or any of Lightning's dependencies into the build environment.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from forkbuild import assemble, upstream
from forkbuild.pin import read_pin


def get_requires_for_build_wheel(config_settings: Optional[Mapping[str, Any]] = None) -> list[str]:
    # pip is needed only to fetch the upstream wheel from the user's index
    return [] if upstream.local_source(config_settings) else ["pip"]


def get_requires_for_build_sdist(config_settings: Optional[Mapping[str, Any]] = None) -> list[str]:
    return []


def build_wheel(
    wheel_directory: str,
    config_settings: Optional[Mapping[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    pin = read_pin()
    with tempfile.TemporaryDirectory(prefix="lightning-fork-") as tmp:
        upstream_wheel = upstream.obtain(pin, Path(tmp), config_settings)
        return assemble.write_wheel(pin, upstream_wheel, Path(wheel_directory)).name


def build_sdist(sdist_directory: str, config_settings: Optional[Mapping[str, Any]] = None) -> str:
    return assemble.write_sdist(read_pin(), Path(sdist_directory)).name
