"""``pip install -e .`` (PEP 660): lightning imported from the patched tree ``.tree/src``, made when missing, refused
with what to run when stale, and a message at interpreter start when the checkout's patches change afterwards.

Each test works on a copy of the build inputs (its own ``.tree/``) and a bare virtual environment (no torch: nothing
here imports lightning, it only finds it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forkbuild import upstream
from forkbuild.pin import Pin

FIND = ("import importlib.util as u, importlib.metadata as m;"
        " print(u.find_spec('lightning').origin); print(m.version('lightning'))")


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One environment without pip (the tests' pip installs into it with ``--python``): seconds to make."""
    venv = tmp_path_factory.mktemp("editable") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    return venv / "bin" / "python"


@pytest.fixture
def editable(helpers, upstream_wheel: Path, bare_venv: Path, tmp_path: Path):
    repo = helpers.copy_build_inputs(tmp_path / "repo")
    env = helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)})
    env.pop("VIRTUAL_ENV", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        if args[:2] == ("-m", "pip"):
            command = [sys.executable, "-m", "pip", "--python", str(bare_venv), *args[2:]]
        else:
            command = [str(bare_venv), *args]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    run.env = env
    return repo, run


def test_pip_install_e_imports_lightning_from_the_tree(editable, pin: Pin) -> None:
    repo, run = editable
    assert not (repo / ".tree").exists()
    done = run("-m", "pip", "install", "--no-deps", "-e", str(repo))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (repo / ".tree" / ".git").is_dir()  # materialised by the build
    found = run("-c", FIND)
    assert found.returncode == 0 and not found.stderr, found.stderr
    origin, version = found.stdout.split()
    assert Path(origin) == (repo / ".tree" / "src" / "lightning" / "__init__.py").resolve()
    assert version == pin.fork_version
    assert (repo / ".tree" / "src" / "lightning" / "version.info").read_text() == f"{pin.fork_version}\n"
    # an edit in the tree is what the environment imports, at once (a top-level probe: lightning's own subpackages
    # would import torch, which this environment has not)
    probe = repo / ".tree" / "src" / "_fork_probe.py"
    probe.write_text("PROBE = 1\n")
    found = run("-c", "import importlib.util as u; print(u.find_spec('_fork_probe').origin)")
    assert found.stdout.strip() == str(probe.resolve())

    # the checkout's patches change (a git pull): every interpreter start says the tree is stale and what to run
    series = repo / "patches" / "series"
    series.write_text(series.read_text() + "# changed\n")
    stale = run("-c", "pass")
    assert "is stale" in stale.stderr and "make tree" in stale.stderr
    # and a reinstall refuses, saying the same
    again = run("-m", "pip", "install", "--no-deps", "-e", str(repo))
    assert again.returncode != 0
    assert "cannot make an editable install" in again.stdout + again.stderr

    # uninstall removes the hook: nothing is printed any more, lightning is gone
    assert run("-m", "pip", "uninstall", "-y", "lightning").returncode == 0
    gone = run("-c", "import importlib.util as u; print(u.find_spec('lightning'))")
    assert gone.stdout.strip() == "None" and not gone.stderr


def test_a_tree_that_matches_the_inputs_is_reused(editable, pin: Pin) -> None:
    """``make tree`` first, then ``pip install -e .``: the same tree, not rebuilt (its commits are kept)."""
    repo, run = editable
    done = subprocess.run([sys.executable, "-m", "forkbuild", "tree"], cwd=repo, capture_output=True, text=True,
                          env=run.env)
    assert done.returncode == 0, done.stderr
    head = subprocess.run(["git", "-C", str(repo / ".tree"), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout
    assert run("-m", "pip", "install", "--no-deps", "-e", str(repo)).returncode == 0
    assert subprocess.run(["git", "-C", str(repo / ".tree"), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout == head


def test_editable_pytorch_lightning_is_refused_saying_what_to_run(editable, helpers) -> None:
    repo, run = editable
    done = run("-m", "pip", "install", "--no-deps", "-e", str(repo / helpers.STANDALONE_RECIPE))
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "editable install exists for `lightning` only" in said
    assert "pip install -e . ./packaging/pytorch-lightning" in said
