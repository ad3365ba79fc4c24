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
    # and a reinstall refuses, saying the same in one line: no traceback (nor pip's AttributeError for the optional
    # metadata hook the backend does not define)
    again = run("-m", "pip", "install", "--no-deps", "-e", str(repo))
    assert again.returncode != 0
    said = again.stdout + again.stderr
    assert said.count("error: cannot make an editable install:") == 1
    assert "Traceback" not in said and "AttributeError" not in said, said

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


def test_pytorch_lightning_from_the_tree_follows_its_edits(editable, helpers, standalone_wheel: Path) -> None:
    """``make tree-standalone`` (``python -m forkbuild tree-standalone``): the standalone wheel built from .tree/'s
    working files. Unedited, it is the standalone wheel of patches/ and src/; edits of upstream files and of our
    modules, committed or not, arrive renamed."""
    repo, run = editable
    forkbuild = [sys.executable, "-m", "forkbuild"]
    assert subprocess.run([*forkbuild, "tree"], cwd=repo, env=run.env, capture_output=True).returncode == 0

    def build() -> dict[str, bytes]:
        done = subprocess.run([*forkbuild, "tree-standalone", "-o", "out"], cwd=repo, env=run.env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        files = helpers.wheel_files(repo / done.stdout.strip())
        return {k: v for k, v in files.items() if ".dist-info/" not in k}

    expected = {k: v for k, v in helpers.wheel_files(standalone_wheel).items() if ".dist-info/" not in k}
    assert build() == expected

    src = repo / ".tree" / "src" / "lightning"
    connector, monitor = src / "fabric" / "connector.py", src / "pytorch" / "callbacks" / "loss_scale_monitor.py"
    connector.write_text(connector.read_text() + "PROBE = 'lightning.fabric.connector'\n")
    monitor.write_text(monitor.read_text() + "PROBE = 'lightning.pytorch.callbacks'\n")
    edited = build()
    assert edited["lightning_fabric/connector.py"].endswith(b"PROBE = 'lightning_fabric.connector'\n")
    assert edited["pytorch_lightning/callbacks/loss_scale_monitor.py"].endswith(b"PROBE = 'pytorch_lightning.callbacks'\n")
    changed = sorted(k for k in expected if edited[k] != expected[k])
    assert changed == ["lightning_fabric/connector.py", "pytorch_lightning/callbacks/loss_scale_monitor.py"]
