"""Shared fixtures for the build's tests: the pinned upstream wheel, the fork's wheel, copies of the build inputs.

Every build here runs the way a user's does, ``python -m pip wheel <source> --no-deps -w DIR`` in a subprocess, except
where a test needs to look inside the backend itself.
"""

from __future__ import annotations

import base64
import hashlib
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
from forkbuild.pin import STANDALONE, Pin, read_pin  # noqa: E402

#: the standalone distribution's build recipe, relative to the repository root
STANDALONE_RECIPE = Path("packaging") / STANDALONE

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
    pip: tuple[str, ...] = ("-m", "pip"),
) -> subprocess.CompletedProcess:
    """``python -m pip wheel SOURCE --no-deps -w OUT`` (``pip``: another pip, as ``(path,)``); returns the finished
    process (stdout and stderr joined)."""
    command = [sys.executable, *pip, "wheel", str(source), "--no-deps", "--no-cache-dir", "-w", str(out)]
    for key, value in (config_settings or {}).items():
        command += ["--config-settings", f"{key}={value}"]
    command += list(extra)
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        command, env=dict(env), cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )


def offline_build(source: str | Path, out: Path, upstream_path: Path, **kwargs) -> subprocess.CompletedProcess:
    """:func:`pip_wheel` offline, ``$LIGHTNING_FORK_UPSTREAM_WHEEL`` set to ``upstream_path``."""
    return pip_wheel(source, out, offline_env(**{upstream.ENV_VAR: str(upstream_path)}), **kwargs)


def only_wheel(out: Path, pin: Pin, done: Optional[subprocess.CompletedProcess] = None) -> Path:
    """The one file a successful build (``done``, when given) leaves: the fork's wheel (``lightning`` or
    ``pytorch-lightning``, as ``pin`` says), under its canonical name."""
    if done is not None:
        assert done.returncode == 0, done.stdout
    found = sorted(p.name for p in out.iterdir())
    assert found == [assemble.wheel_name(pin)], found
    return out / found[0]


def same_wheel(wheel: Path, out: Path, pin: Pin, done: subprocess.CompletedProcess) -> None:
    """The build ``done`` succeeded and left the bytes of ``wheel`` (a session fixture's wheel of the same inputs)."""
    assert only_wheel(out, pin, done).read_bytes() == wheel.read_bytes()


def refused(done: subprocess.CompletedProcess, out: Path, *messages: str) -> None:
    """The build failed, saying each of ``messages``, and left nothing in ``out``."""
    assert done.returncode != 0
    for message in messages:
        assert message in done.stdout, done.stdout
    assert not list(out.iterdir()), f"a failed build left {sorted(p.name for p in out.iterdir())} behind"


def commit_all(repo: Path) -> str:
    """``git init``, add and commit everything in ``repo``; returns the commit."""
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "build inputs"]):
        subprocess.run(git + args, check=True, capture_output=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def record_hash(data: bytes) -> str:
    """A RECORD row's hash of ``data`` (PEP 376), computed here, not by forkbuild."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def git_apply_series(files: dict[str, bytes], patches: list[tuple[str, bytes]], tmp: Path) -> dict[str, bytes]:
    """``files`` laid out under ``tmp/tree/src``, then each patch (name, text) applied there by ``git apply``, in order:
    the tree's files, rebuilt without forkbuild's applier."""
    src = tmp / "tree" / "src"
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    for name, text in patches:
        (tmp / name).write_bytes(text)
        done = subprocess.run(["git", "apply", "--verbose", str(tmp / name)], cwd=src.parent, capture_output=True,
                              text=True)
        assert done.returncode == 0, f"git apply {name}:\n{done.stderr}"
    return {path.relative_to(src).as_posix(): path.read_bytes() for path in src.rglob("*") if path.is_file()}


def copy_build_inputs(dest: Path, source: Path = REPO) -> Path:
    """A copy of what the build reads (the sdist's members), so a test may break it without touching the repo."""
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")
    for name in assemble.SDIST_MEMBERS:
        path = source / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=ignore)
        elif path.is_file():
            shutil.copy2(path, dest / name)
    return dest


def _download(requirement: str, folder: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "--only-binary=:all:", "-d", str(folder)],
        env=base_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"pip download {requirement} failed:\n{done.stderr}"


@pytest.fixture(scope="session")
def newest_pip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The newest pip the configured index offers, as a wheel file (pip runs from its own wheel: ``python
    pip.whl/pip``), beside the 23.2.1 that ``python -m venv`` puts into the environment."""
    folder = tmp_path_factory.mktemp("newest-pip")
    _download("pip", folder)
    return next(folder.glob("pip-*.whl"))


@pytest.fixture(scope="session")
def pin() -> Pin:
    return read_pin()


@pytest.fixture(scope="session")
def upstream_dir(pin: Pin, standalone_pin: Pin, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder with both pinned upstream wheels (lightning, pytorch_lightning): ``$LIGHTNING_FORK_UPSTREAM_WHEEL``
    (a folder, or a file whose folder holds both) or else ``pip download``. Pointing the build at either wheel of it
    serves both flavours."""
    given = os.environ.get(upstream.ENV_VAR)
    if given:
        path = Path(given).expanduser()
        folder = path if path.is_dir() else path.parent
    else:
        folder = tmp_path_factory.mktemp("upstream")
    for p in (pin, standalone_pin):
        if not (folder / p.filename).is_file():
            assert not given, f"{upstream.ENV_VAR}={given}: no {p.filename} there (both upstream wheels are needed)"
            _download(p.requirement, folder)
        assert upstream.sha256_of(folder / p.filename) == p.sha256, f"{folder / p.filename} is not the pinned wheel"
    return folder


@pytest.fixture(scope="session")
def upstream_wheel(pin: Pin, upstream_dir: Path) -> Path:
    """The pinned upstream ``lightning`` wheel."""
    return upstream_dir / pin.filename


@pytest.fixture(scope="session")
def standalone_pin() -> Pin:
    return read_pin(distribution=STANDALONE)


@pytest.fixture(scope="session")
def standalone_upstream_wheel(standalone_pin: Pin, upstream_dir: Path) -> Path:
    """The pinned upstream ``pytorch_lightning`` wheel."""
    return upstream_dir / standalone_pin.filename


def wheel_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}


@pytest.fixture(scope="session")
def standalone_upstream_files(standalone_upstream_wheel: Path) -> dict[str, bytes]:
    return wheel_files(standalone_upstream_wheel)


@pytest.fixture(scope="session")
def standalone_wheel(
    standalone_pin: Pin, upstream_wheel: Path, repo_snapshot: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The fork's ``pytorch-lightning`` wheel, built by pip from packaging/pytorch-lightning of the build inputs,
    offline (the setting names the lightning wheel: the build takes the pytorch_lightning wheel beside it)."""
    out = tmp_path_factory.mktemp("standalone-wheel")
    return only_wheel(out, standalone_pin, offline_build(repo_snapshot / STANDALONE_RECIPE, out, upstream_wheel))


@pytest.fixture(scope="session")
def standalone_files(standalone_wheel: Path) -> dict[str, bytes]:
    return wheel_files(standalone_wheel)


def build_stock(repo: Path, upstream_dir: Path, out: Path) -> Path:
    """``python -m forkbuild wheel --flavour stock-pytorch-lightning`` (what the Makefile runs), offline."""
    done = subprocess.run(
        [sys.executable, "-m", "forkbuild", "wheel", "--flavour", assemble.STOCK, "-o", str(out)], cwd=repo,
        env=offline_env(**{upstream.ENV_VAR: str(upstream_dir)}), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    wheels = sorted(out.glob("*.whl"))
    assert [w.name for w in wheels] == ["stock_pytorch_lightning-2.6.6-py3-none-any.whl"]
    return wheels[0]


@pytest.fixture(scope="session")
def stock_wheel(upstream_dir: Path, repo_snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' unpatched stock 2.6.6, renamed to ``stock_pytorch_lightning`` / ``stock_lightning_fabric``."""
    return build_stock(repo_snapshot, upstream_dir, tmp_path_factory.mktemp("stock-wheel"))


@pytest.fixture(scope="session")
def upstream_files(upstream_wheel: Path) -> dict[str, bytes]:
    return wheel_files(upstream_wheel)


@pytest.fixture(scope="session")
def repo_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's build inputs as they were when the session began: tests that compare a wheel with the inputs
    it was built from read them here, so that edits to the working tree during a run cannot set the two apart."""
    return copy_build_inputs(tmp_path_factory.mktemp("snapshot") / "repo")


@pytest.fixture(scope="session")
def fork_wheel(pin: Pin, upstream_wheel: Path, repo_snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fork's wheel, built by pip from this repository's build inputs (``repo_snapshot``), offline, from the
    local upstream wheel: what every other route to a wheel of those inputs must reproduce byte for byte."""
    out = tmp_path_factory.mktemp("fork-wheel")
    return only_wheel(out, pin, offline_build(repo_snapshot, out, upstream_wheel))


@pytest.fixture(scope="session")
def fork_files(fork_wheel: Path) -> dict[str, bytes]:
    return wheel_files(fork_wheel)


@pytest.fixture
def repo_copy(repo_snapshot: Path, tmp_path: Path) -> Path:
    """A copy of ``repo_snapshot``: its wheels are ``fork_wheel`` and ``standalone_wheel``, whatever the working tree
    became since."""
    return copy_build_inputs(tmp_path / "repo", source=repo_snapshot)


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """The helpers above, for test modules (a conftest is not importable under ``--import-mode=importlib``)."""
    names = ("REPO", "STANDALONE_RECIPE", "base_env", "offline_env", "pip_wheel", "offline_build", "only_wheel",
             "same_wheel", "refused", "commit_all", "record_hash", "git_apply_series", "copy_build_inputs",
             "wheel_files", "build_stock")
    return SimpleNamespace(**{name: globals()[name] for name in names})
