"""Shared fixtures for the build's tests: the pinned upstream wheel, the fork's wheel, copies of the build inputs.

Every build here runs the way a user's does, ``python -m pip wheel <source> --no-deps -w DIR`` in a subprocess, except
where a test needs to look inside the backend itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `forkbuild` lives at the repository root, which is not a test path
    sys.path.insert(0, str(REPO))

from forkbuild import assemble, upstream  # noqa: E402
from forkbuild.pin import Pin, read_pin  # noqa: E402

# pip settings that would let a build reach a package index; `offline_env` removes them all
_INDEX_VARS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "UV_DEFAULT_INDEX", "UV_INDEX_URL",
               "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: builds a virtual environment and installs torch into it (about a minute)")


def base_env(**overrides: Optional[str]) -> dict[str, str]:
    """The test's environment without any upstream-wheel setting; ``None`` removes a variable."""
    env = {k: v for k, v in os.environ.items() if k not in (upstream.ENV_VAR, "PYTHONPATH", "PYTHONHOME")}
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def offline_env(**overrides: Optional[str]) -> dict[str, str]:
    """An environment in which pip can reach no index at all: no config file, no index, no find-links."""
    env = base_env(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    for key in _INDEX_VARS:
        env.pop(key, None)
    env.update({k: v for k, v in overrides.items() if v is not None})
    return env


def pip_wheel(
    source: str | Path,
    out: Path,
    env: Mapping[str, str],
    config_settings: Optional[Mapping[str, str]] = None,
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``python -m pip wheel SOURCE --no-deps -w OUT``; returns the finished process (stdout and stderr joined)."""
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-cache-dir", "-w", str(out)]
    for key, value in (config_settings or {}).items():
        command += ["--config-settings", f"{key}={value}"]
    command += list(extra)
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        command, env=dict(env), cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )


def only_wheel(out: Path, pin: Pin) -> Path:
    """The one file a successful build leaves: the fork's wheel, under its canonical name."""
    found = sorted(p.name for p in out.iterdir())
    assert found == [assemble.wheel_name(pin)], found
    return out / found[0]


def copy_build_inputs(dest: Path) -> Path:
    """A copy of what the build reads (the sdist's members), so a test may break it without touching the repo."""
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")
    for name in assemble.SDIST_MEMBERS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=ignore)
        elif path.is_file():
            shutil.copy2(path, dest / name)
    return dest


@pytest.fixture(scope="session")
def pin() -> Pin:
    return read_pin()


@pytest.fixture(scope="session")
def upstream_wheel(pin: Pin, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned upstream wheel: ``$LIGHTNING_FORK_UPSTREAM_WHEEL`` (file or folder) or else ``pip download``."""
    given = os.environ.get(upstream.ENV_VAR)
    if given:
        path = Path(given).expanduser()
        wheel = path / pin.filename if path.is_dir() else path
    else:
        folder = tmp_path_factory.mktemp("upstream")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", pin.requirement, "--no-deps", "--only-binary=:all:", "-d",
             str(folder)],
            env=base_env(), capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, f"pip download {pin.requirement} failed:\n{done.stderr}"
        wheel = folder / pin.filename
    assert wheel.is_file(), f"no upstream wheel at {wheel}"
    assert upstream.sha256_of(wheel) == pin.sha256, f"{wheel} is not the pinned upstream wheel"
    return wheel


@pytest.fixture(scope="session")
def upstream_files(upstream_wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(upstream_wheel) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}


@pytest.fixture(scope="session")
def repo_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's build inputs as they were when the session began: tests that compare a wheel with the inputs
    it was built from read them here, so that edits to the working tree during a run cannot set the two apart."""
    return copy_build_inputs(tmp_path_factory.mktemp("snapshot") / "repo")


@pytest.fixture(scope="session")
def fork_wheel(pin: Pin, upstream_wheel: Path, repo_snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fork's wheel, built by pip from this repository's build inputs (``repo_snapshot``), offline, from the
    local upstream wheel."""
    out = tmp_path_factory.mktemp("fork-wheel")
    done = pip_wheel(repo_snapshot, out, offline_env(**{upstream.ENV_VAR: str(upstream_wheel)}))
    assert done.returncode == 0, done.stdout
    return only_wheel(out, pin)


@pytest.fixture(scope="session")
def fork_files(fork_wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(fork_wheel) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    return copy_build_inputs(tmp_path / "repo")


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """The helpers above, for test modules (a conftest is not importable under ``--import-mode=importlib``)."""
    return SimpleNamespace(
        REPO=REPO,
        base_env=base_env,
        offline_env=offline_env,
        pip_wheel=pip_wheel,
        only_wheel=only_wheel,
        copy_build_inputs=copy_build_inputs,
    )
