"""Building the wheel the way users do: offline from a local upstream wheel, from an index, from git, from the sdist;
and the build's refusals (a wrong hash, a patch that does not apply, a module that would overwrite upstream)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Optional

import pytest

from forkbuild import backend, upstream
from forkbuild.pin import Pin

BUILD_SECONDS = 30


def _wheel_names(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as z:
        return set(z.namelist())


def _assert_nothing_built(out: Path) -> None:
    assert not list(out.iterdir()), f"a failed build left {sorted(p.name for p in out.iterdir())} behind"


@pytest.fixture
def reference(helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, tmp_path: Path) -> bytes:
    """The wheel built offline (env var) from ``repo_copy``: what every other route to a wheel must reproduce byte for
    byte. (A copy, so that edits to the working tree during the run cannot make two builds differ.)"""
    env = helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)})
    done = helpers.pip_wheel(repo_copy, tmp_path / "reference", env)
    assert done.returncode == 0, done.stdout
    return helpers.only_wheel(tmp_path / "reference", pin).read_bytes()


# --- offline builds ---------------------------------------------------------------------------------------------------


def test_offline_build_from_env_var(helpers, pin: Pin, upstream_wheel: Path, tmp_path: Path) -> None:
    env = helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)})
    start = time.monotonic()
    done = helpers.pip_wheel(helpers.REPO, tmp_path / "out", env)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout
    wheel = helpers.only_wheel(tmp_path / "out", pin)
    assert f"{pin.name}-{pin.fork_version}.dist-info/RECORD" in _wheel_names(wheel)
    assert elapsed < BUILD_SECONDS, f"building the wheel took {elapsed:.1f}s"


@pytest.mark.parametrize("given", ["file", "folder"])
def test_offline_build_from_config_setting_is_identical(
    helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, reference: bytes, tmp_path: Path, given: str
) -> None:
    """``--config-settings upstream-wheel=PATH`` (the wheel or its folder) works as the env var does, and the build
    is reproducible: the same bytes every time."""
    env = helpers.offline_env()
    assert upstream.ENV_VAR not in env
    source = upstream_wheel if given == "file" else upstream_wheel.parent
    settings = {upstream.CONFIG_SETTING: str(source)}
    done = helpers.pip_wheel(repo_copy, tmp_path / "out", env, config_settings=settings)
    assert done.returncode == 0, done.stdout
    assert helpers.only_wheel(tmp_path / "out", pin).read_bytes() == reference


def test_offline_build_without_a_local_wheel_fails_clearly(helpers, pin: Pin, tmp_path: Path) -> None:
    """Control for the offline tests: with no local wheel and no index the build cannot succeed, and says why."""
    done = helpers.pip_wheel(helpers.REPO, tmp_path / "out", helpers.offline_env(), extra=("--no-build-isolation",))
    assert done.returncode != 0
    assert f"pip download {pin.requirement}" in done.stdout
    assert upstream.ENV_VAR in done.stdout
    _assert_nothing_built(tmp_path / "out")


def test_missing_local_wheel_is_named(helpers, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "lightning.whl"
    done = helpers.pip_wheel(helpers.REPO, tmp_path / "out", helpers.offline_env(**{upstream.ENV_VAR: str(missing)}))
    assert done.returncode != 0
    assert str(missing) in done.stdout
    _assert_nothing_built(tmp_path / "out")


# --- builds from an index, from git, from the sdist -------------------------------------------------------------------


def _simple_index(root: Path, wheel: Path) -> str:
    """A PEP 503 index on disk that serves only the upstream wheel; returns its file:// URL."""
    project = root / "simple" / "lightning"
    project.mkdir(parents=True)
    (project / wheel.name).write_bytes(wheel.read_bytes())
    (project / "index.html").write_text(f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>\n')
    return (root / "simple").as_uri()


@pytest.mark.parametrize("variable", ["PIP_INDEX_URL", "UV_INDEX_URL"])
def test_build_downloads_from_the_configured_index(
    helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, reference: bytes, tmp_path: Path, variable: str
) -> None:
    """No local wheel: the build asks pip, which must use the user's index (and uv's setting when pip has none)."""
    url = _simple_index(tmp_path / "index", upstream_wheel)
    unset = dict.fromkeys(["PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"])
    env = helpers.base_env(PIP_CONFIG_FILE=os.devnull, **{**unset, variable: url})
    # without build isolation: the tiny index holds no pip for the isolated build environment to install
    done = helpers.pip_wheel(repo_copy, tmp_path / "out", env, extra=("--no-build-isolation",))
    assert done.returncode == 0, done.stdout
    assert helpers.only_wheel(tmp_path / "out", pin).read_bytes() == reference


def test_build_with_isolation_downloads_through_pip_config(
    helpers, pin: Pin, repo_copy: Path, reference: bytes, tmp_path: Path
) -> None:
    """What ``pip install git+...`` does where pip is configured: an isolated build, upstream from the index."""
    done = helpers.pip_wheel(repo_copy, tmp_path / "out", helpers.base_env())
    if done.returncode != 0 and ("No matching distribution" in done.stdout or "Could not find" in done.stdout):
        pytest.skip("the configured package index is not reachable from here")
    assert done.returncode == 0, done.stdout
    assert helpers.only_wheel(tmp_path / "out", pin).read_bytes() == reference


def _commit(repo: Path) -> str:
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "build inputs"]):
        subprocess.run(git + args, check=True, capture_output=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def _companion_line(metadata: str) -> str:
    (line,) = [ln for ln in metadata.splitlines() if ln.startswith("Requires-Dist: pytorch-lightning")]
    return line


def _metadata_but_the_companion(metadata: str) -> list[str]:
    return [ln for ln in metadata.splitlines() if not ln.startswith("Requires-Dist: pytorch-lightning")]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_build_from_a_git_url(
    helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, reference: bytes, tmp_path: Path
) -> None:
    """``pip install git+<repo>`` sees only committed files: the committed build inputs must be enough. Built in
    pip's clone, the wheel is the reference but for lightning's requirement on its companion, which names the same
    URL and commit (forkbuild/companion.py; ``file://localhost/``, which pip < 24 accepts in a requirement)."""
    commit = _commit(repo_copy)
    env = helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)})
    done = helpers.pip_wheel(f"git+{repo_copy.as_uri()}", tmp_path / "out", env)
    assert done.returncode == 0, done.stdout
    built = helpers.wheel_files(helpers.only_wheel(tmp_path / "out", pin))
    (tmp_path / "reference.whl").write_bytes(reference)
    expected = helpers.wheel_files(tmp_path / "reference.whl")
    dist_info = f"{pin.name}-{pin.fork_version}.dist-info"
    assert built.keys() == expected.keys()
    package = [k for k in expected if not k.startswith(dist_info + "/")]
    assert [built[k] for k in package] == [expected[k] for k in package]
    ours, theirs = (files[f"{dist_info}/METADATA"].decode() for files in (built, expected))
    assert _metadata_but_the_companion(ours) == _metadata_but_the_companion(theirs)
    assert _companion_line(theirs) == f"Requires-Dist: pytorch-lightning=={pin.fork_version}"
    assert _companion_line(ours) == (
        f"Requires-Dist: pytorch-lightning @ git+file://localhost{repo_copy.as_posix()}@{commit}"
        "#subdirectory=packaging/pytorch-lightning"
    )


def _uv() -> Optional[str]:
    found = Path(sys.executable).with_name("uv")
    return str(found) if found.is_file() else shutil.which("uv")


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.skipif(_uv() is None, reason="uv is not installed (requirements/test.txt installs it)")
def test_uv_pip_install_from_a_git_url(
    helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, reference: bytes, tmp_path: Path
) -> None:
    """``uv pip install git+<repo>`` builds through the same backend and installs the same files as the wheel."""
    repo = repo_copy
    commit = _commit(repo)
    env = helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel), "UV_CACHE_DIR": str(tmp_path / "uv-cache")})
    venv = tmp_path / "venv"
    subprocess.run([_uv(), "venv", "-q", str(venv)], check=True, env=env, capture_output=True)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [_uv(), "pip", "install", "--offline", "--no-deps", "--python", str(python), f"git+{repo.as_uri()}"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    dist_info = f"{pin.name}-{pin.fork_version}.dist-info"
    with zipfile.ZipFile(io.BytesIO(reference)) as z:
        expected = {row.split(",")[0]: row.split(",")[1] for row in z.read(f"{dist_info}/RECORD").decode().splitlines()}
    site = next(venv.glob("lib/python*/site-packages"))
    installed = {
        row.split(",")[0]: row.split(",")[1] for row in (site / dist_info / "RECORD").read_text().splitlines()
    }
    # uv adds its own INSTALLER (and REQUESTED) files; everything from the wheel is installed unchanged, but for the
    # metadata's requirement on the companion: the URL given to uv (which its clone's FETCH_HEAD records), not uv's
    # clone in its cache (tests/tests_forkbuild/test_pinned_git_url.py: the lock that follows works anywhere)
    metadata = f"{dist_info}/METADATA"
    assert {k: v for k, v in installed.items() if k in expected and k != metadata} == {
        k: v for k, v in expected.items() if k != metadata
    }
    with zipfile.ZipFile(io.BytesIO(reference)) as z:
        theirs = z.read(metadata).decode()
    ours = (site / metadata).read_text()
    assert _metadata_but_the_companion(ours) == _metadata_but_the_companion(theirs)
    companion = _companion_line(ours)
    assert companion == (
        f"Requires-Dist: pytorch-lightning @ git+file://localhost{repo.as_posix()}@{commit}"
        "#subdirectory=packaging/pytorch-lightning"
    )


def test_sdist_holds_the_recipe_and_builds_the_same_wheel(
    helpers, pin: Pin, upstream_wheel: Path, upstream_files: dict[str, bytes], repo_copy: Path, reference: bytes,
    tmp_path: Path,
) -> None:
    code = "import sys; from forkbuild import backend; print(backend.build_sdist(sys.argv[1]))"
    (tmp_path / "sdist").mkdir()
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sdist")], cwd=repo_copy,
                          capture_output=True, text=True, env=helpers.base_env())
    assert done.returncode == 0, done.stderr
    sdist = tmp_path / "sdist" / done.stdout.strip()
    with tarfile.open(sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers()}
    assert {"PKG-INFO", "pyproject.toml", "upstream.toml", "forkbuild/backend.py"} <= names
    # the recipe only: upstream's files never travel in the sdist (our own modules do, under src/)
    assert not [n for n in names if n.startswith("lightning/")]
    assert not {n[len("src/") :] for n in names if n.startswith("src/")} & set(upstream_files)
    done = helpers.pip_wheel(sdist, tmp_path / "out", helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)}))
    assert done.returncode == 0, done.stdout
    assert helpers.only_wheel(tmp_path / "out", pin).read_bytes() == reference


# --- refusals ---------------------------------------------------------------------------------------------------------


def test_wheel_with_one_byte_changed_is_refused(helpers, pin: Pin, upstream_wheel: Path, tmp_path: Path) -> None:
    data = bytearray(upstream_wheel.read_bytes())
    data[len(data) // 2] ^= 0x01
    tampered = tmp_path / "in" / pin.filename
    tampered.parent.mkdir()
    tampered.write_bytes(bytes(data))
    actual = upstream.sha256_of(tampered)
    assert actual != pin.sha256

    done = helpers.pip_wheel(helpers.REPO, tmp_path / "out", helpers.offline_env(**{upstream.ENV_VAR: str(tampered)}))
    assert done.returncode != 0
    assert "upstream.toml" in done.stdout
    assert f"expected sha256 {pin.sha256}" in done.stdout
    assert f"actual sha256   {actual}" in done.stdout
    _assert_nothing_built(tmp_path / "out")


def _add_patch(repo: Path, name: str, text: str) -> None:
    (repo / "patches" / name).write_text(text)
    series = repo / "patches" / "series"
    before = series.read_text() if series.is_file() else ""
    series.write_text(before + ("" if before.endswith("\n") or not before else "\n") + name + "\n")


def test_broken_patch_is_refused_naming_patch_and_file(
    helpers, upstream_wheel: Path, upstream_files: dict[str, bytes], tmp_path: Path
) -> None:
    repo = helpers.copy_build_inputs(tmp_path / "repo")
    target = "lightning/__version__.py"
    assert target in upstream_files
    _add_patch(
        repo,
        "9999-context-that-upstream-never-had.patch",
        "A patch written against a file that does not look like this.\n\n"
        f"--- a/src/{target}\n+++ b/src/{target}\n"
        "@@ -1,3 +1,4 @@\n first line this file never had\n+an added line\n second such line\n third such line\n",
    )
    done = helpers.pip_wheel(repo, tmp_path / "out", helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)}))
    assert done.returncode != 0
    assert (
        "patch 9999-context-that-upstream-never-had.patch does not apply to src/lightning/__version__.py" in done.stdout
    )
    _assert_nothing_built(tmp_path / "out")


def test_patch_for_a_file_upstream_lacks_is_refused(helpers, upstream_wheel: Path, tmp_path: Path) -> None:
    repo = helpers.copy_build_inputs(tmp_path / "repo")
    ghost = "--- a/src/lightning/ghost.py\n+++ b/src/lightning/ghost.py\n@@ -1 +1 @@\n-a\n+b\n"
    _add_patch(repo, "9998-ghost.patch", ghost)
    done = helpers.pip_wheel(repo, tmp_path / "out", helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)}))
    assert done.returncode != 0
    assert "9998-ghost.patch" in done.stdout and "src/lightning/ghost.py" in done.stdout
    _assert_nothing_built(tmp_path / "out")


def test_module_that_would_overwrite_upstream_is_refused(helpers, upstream_wheel: Path, tmp_path: Path) -> None:
    repo = helpers.copy_build_inputs(tmp_path / "repo")
    clash = repo / "src" / "lightning" / "__version__.py"
    clash.parent.mkdir(parents=True, exist_ok=True)
    clash.write_text("version = 'mine'\n")
    done = helpers.pip_wheel(repo, tmp_path / "out", helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)}))
    assert done.returncode != 0
    assert "src/ would overwrite upstream files" in done.stdout and "lightning/__version__.py" in done.stdout
    _assert_nothing_built(tmp_path / "out")


@pytest.mark.parametrize("parent", ["checkout.pyc", "__pycache__"])
def test_own_modules_ship_wherever_the_checkout_lives(
    helpers, pin: Pin, upstream_wheel: Path, tmp_path: Path, parent: str
) -> None:
    """A new module under src/ ends up in the wheel, even when a folder above the checkout has a name the build skips
    inside src/ (caches)."""
    repo = helpers.copy_build_inputs(tmp_path / parent / "repo")
    probe = repo / "src" / "lightning" / "pytorch" / "_fork_probe.py"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text("PROBE = 1\n")
    cache = probe.parent / "__pycache__" / "_fork_probe.cpython-311.pyc"
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(b"not a module")
    done = helpers.pip_wheel(repo, tmp_path / "out", helpers.offline_env(**{upstream.ENV_VAR: str(upstream_wheel)}))
    assert done.returncode == 0, done.stdout
    wheel = helpers.only_wheel(tmp_path / "out", pin)
    with zipfile.ZipFile(wheel) as z:
        assert z.read("lightning/pytorch/_fork_probe.py") == b"PROBE = 1\n"
        assert not [n for n in z.namelist() if "__pycache__" in n or n.endswith(".pyc")]
        fork_txt = z.read(f"{pin.name}-{pin.fork_version}.dist-info/FORK.txt").decode()
    assert "lightning/pytorch/_fork_probe.py" in fork_txt


# --- no torch, no heavy build environment -----------------------------------------------------------------------------


def test_build_requires_nothing_heavy(helpers, upstream_wheel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tomllib = pytest.importorskip("tomllib")
    build_system = tomllib.loads((helpers.REPO / "pyproject.toml").read_text())["build-system"]
    assert build_system["requires"] == []
    assert build_system["build-backend"] == "forkbuild.backend"
    assert backend.get_requires_for_build_wheel({upstream.CONFIG_SETTING: str(upstream_wheel)}) == []
    monkeypatch.delenv(upstream.ENV_VAR, raising=False)
    assert backend.get_requires_for_build_wheel({}) == ["pip"]  # only to download upstream's wheel
    assert backend.get_requires_for_build_sdist({}) == []


def test_backend_does_not_import_torch(helpers, pin: Pin, upstream_wheel: Path, tmp_path: Path) -> None:
    """Run the backend's build_wheel in a fresh interpreter and look at what it imported. (The interpreter is the
    tests', which has torch: an import of torch anywhere in the build would succeed and show here.)"""
    code = (
        "import json, sys\n"
        "from forkbuild import backend\n"
        "name = backend.build_wheel(sys.argv[1], {'upstream-wheel': sys.argv[2]})\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in"
        " {'torch', 'lightning', 'lightning_fabric', 'pytorch_lightning', 'numpy', 'torchmetrics'})\n"
        "print(json.dumps({'name': name, 'heavy': heavy}))\n"
    )
    (tmp_path / "out").mkdir()
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out"), str(upstream_wheel)],
                          cwd=helpers.REPO, capture_output=True, text=True, env=helpers.offline_env())
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"name": f"{pin.name}-{pin.fork_version}-py3-none-any.whl", "heavy": []}
    assert elapsed < BUILD_SECONDS
