"""PEP 517 / PEP 660 build backend: what ``pip install git+<repo>``, ``uv pip install`` and ``pip install .`` call.

It needs nothing but the standard library (and pip, only to download the upstream wheel when no local copy is
given); in particular it never installs torch or any of Lightning's dependencies into the build environment.

The repository root's pyproject.toml builds ``lightning``; ``packaging/pytorch-lightning/pyproject.toml`` builds the
standalone ``pytorch-lightning`` through the same hooks (its backend module sets the flavour). The config setting
``flavour`` (``--config-settings flavour=pytorch-lightning``) chooses one explicitly.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

from forkbuild import assemble, companion, editable, upstream
from forkbuild.pin import ROOT, BuildError

FLAVOUR_SETTING = "flavour"


def _flavour(config_settings: Optional[Mapping[str, Any]], default: str) -> assemble.Flavour:
    return assemble.flavour((config_settings or {}).get(FLAVOUR_SETTING) or default)


def _exits_with_the_message(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook whose :class:`BuildError` ends the build with its message alone. pip and uv print a failed hook's
    traceback, and pip, when the hook stood in for an optional one we do not define (``prepare_metadata_for_build_*``),
    the ``AttributeError`` of that lookup above it; the message is all a user needs."""

    @functools.wraps(hook)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except BuildError as err:
            raise SystemExit(f"error: {err}") from None

    return wrapper


def hooks(default: str = "lightning") -> SimpleNamespace:
    """The PEP 517/660 hooks for one flavour (the one ``default`` names, unless the config setting says otherwise)."""

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
        flv = _flavour(config_settings, default)
        pin = assemble.flavour_pin(flv)
        # built in pip's or uv's clone of a git URL, lightning names its companion there (one URL installs both)
        reference = companion.direct_reference(ROOT) if flv.name == "lightning" else None
        with tempfile.TemporaryDirectory(prefix="lightning-fork-") as tmp:
            upstream_wheel = upstream.obtain(pin, Path(tmp), config_settings)
            return assemble.write_wheel(pin, upstream_wheel, Path(wheel_directory), flv, reference).name

    def build_sdist(sdist_directory: str, config_settings: Optional[Mapping[str, Any]] = None) -> str:
        flv = _flavour(config_settings, default)
        return assemble.write_sdist(assemble.flavour_pin(flv), Path(sdist_directory), flv).name

    def get_requires_for_build_editable(config_settings: Optional[Mapping[str, Any]] = None) -> list[str]:
        return get_requires_for_build_wheel(config_settings)

    def build_editable(
        wheel_directory: str,
        config_settings: Optional[Mapping[str, Any]] = None,
        metadata_directory: Optional[str] = None,
    ) -> str:
        flv = _flavour(config_settings, default)
        if flv.name != "lightning":
            raise BuildError(
                f"an editable install exists for `lightning` only (it points at the patched tree .tree/src, which is"
                f" in lightning's layout); {flv.name} is generated from it. Install it normally beside the editable"
                f" lightning, from the repository root:\n    pip install -e . ./packaging/pytorch-lightning"
            )
        pin = assemble.flavour_pin(flv)
        with tempfile.TemporaryDirectory(prefix="lightning-fork-") as tmp:
            upstream_wheel = upstream.obtain(pin, Path(tmp), config_settings)
            return editable.write_editable_wheel(pin, upstream_wheel, Path(wheel_directory), config_settings).name

    return SimpleNamespace(
        **{k: _exits_with_the_message(v) for k, v in locals().items() if callable(v) and not k.startswith("_")}
    )


_lightning = hooks("lightning")
get_requires_for_build_wheel = _lightning.get_requires_for_build_wheel
get_requires_for_build_sdist = _lightning.get_requires_for_build_sdist
get_requires_for_build_editable = _lightning.get_requires_for_build_editable
build_wheel = _lightning.build_wheel
build_sdist = _lightning.build_sdist
build_editable = _lightning.build_editable
