"""Building the wheel the way users do: offline from a local upstream wheel, from an index, from git, from the sdist;
and the build's refusals (a wrong hash, a patch that does not apply, a module that would overwrite upstream)."""

from __future__ import annotations

import json
import os
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


# --- offline builds ---------------------------------------------------------------------------------------------------


def test_offline_build_from_env_var(helpers, pin: Pin, upstream_wheel: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    done = helpers.offline_build(helpers.REPO, tmp_path / "out", upstream_wheel)
    elapsed = time.monotonic() - start
    with zipfile.ZipFile(helpers.only_wheel(tmp_path / "out", pin, done)) as z:
        assert f"{pin.name}-{pin.fork_version}.dist-info/RECORD" in z.namelist()
    assert elapsed < BUILD_SECONDS, f"building the wheel took {elapsed:.1f}s"


@pytest.mark.parametrize("given", ["file", "folder"])
def test_offline_build_from_config_setting_is_identical(
    helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, fork_wheel: Path, tmp_path: Path, given: str
) -> None:
    """``--config-settings upstream-wheel=PATH`` (the wheel or its folder) works as the env var does, and the build
    is reproducible: the same bytes every time."""
    env = helpers.offline_env()
    assert upstream.ENV_VAR not in env
    settings = {upstream.CONFIG_SETTING: str(upstream_wheel if given == "file" else upstream_wheel.parent)}
    done = helpers.pip_wheel(repo_copy, tmp_path / "out", env, config_settings=settings)
    helpers.same_wheel(fork_wheel, tmp_path / "out", pin, done)


def test_offline_build_without_a_local_wheel_fails_clearly(helpers, pin: Pin, tmp_path: Path) -> None:
    """Control for the offline tests: with no local wheel and no index the build cannot succeed, and says why."""
    done = helpers.pip_wheel(helpers.REPO, tmp_path / "out", helpers.offline_env(), extra=("--no-build-isolation",))
    helpers.refused(done, tmp_path / "out", f"pip download {pin.requirement}", upstream.ENV_VAR)


def test_missing_local_wheel_is_named(helpers, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "lightning.whl"
    helpers.refused(helpers.offline_build(helpers.REPO, tmp_path / "out", missing), tmp_path / "out", str(missing))


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
    helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, fork_wheel: Path, tmp_path: Path, variable: str
) -> None:
    """No local wheel: the build asks pip, which must use the user's index (and uv's setting when pip has none)."""
    url = _simple_index(tmp_path / "index", upstream_wheel)
    unset = dict.fromkeys(["PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"])
    env = helpers.base_env(PIP_CONFIG_FILE=os.devnull, **{**unset, variable: url})
    # without build isolation: the tiny index holds no pip for the isolated build environment to install
    done = helpers.pip_wheel(repo_copy, tmp_path / "out", env, extra=("--no-build-isolation",))
    helpers.same_wheel(fork_wheel, tmp_path / "out", pin, done)


def test_build_with_isolation_downloads_through_pip_config(
    helpers, pin: Pin, repo_copy: Path, fork_wheel: Path, tmp_path: Path
) -> None:
    """What ``pip install git+...`` does where pip is configured: an isolated build, upstream from the index."""
    done = helpers.pip_wheel(repo_copy, tmp_path / "out", helpers.base_env())
    if done.returncode != 0 and ("No matching distribution" in done.stdout or "Could not find" in done.stdout):
        pytest.skip("the configured package index is not reachable from here")
    helpers.same_wheel(fork_wheel, tmp_path / "out", pin, done)


def _assert_the_companion_is_the_git_commit(ours: str, theirs: str, pin: Pin, repo: Path, commit: str) -> None:
    """METADATA ``ours``, built from a git URL, is ``theirs`` (the offline build's) but for lightning's requirement on
    its companion, which names the same URL and commit."""
    companion = "Requires-Dist: pytorch-lightning"
    assert [ln for ln in ours.splitlines() if not ln.startswith(companion)] == [
        ln for ln in theirs.splitlines() if not ln.startswith(companion)]
    (line,) = [ln for ln in theirs.splitlines() if ln.startswith(companion)]
    assert line == f"{companion}=={pin.fork_version}"
    (line,) = [ln for ln in ours.splitlines() if ln.startswith(companion)]
    url = f"git+file://localhost{repo.as_posix()}@{commit}"
    assert line == f"{companion} @ {url}#subdirectory=packaging/pytorch-lightning"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_build_from_a_git_url(
    helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, fork_files: dict[str, bytes], tmp_path: Path
) -> None:
    """``pip install git+<repo>`` sees only committed files: the committed build inputs must be enough. Built in
    pip's clone, the wheel is the reference but for lightning's requirement on its companion, which names the same
    URL and commit (forkbuild/companion.py; ``file://localhost/``, which pip < 24 accepts in a requirement)."""
    commit = helpers.commit_all(repo_copy)
    done = helpers.offline_build(f"git+{repo_copy.as_uri()}", tmp_path / "out", upstream_wheel)
    built = helpers.wheel_files(helpers.only_wheel(tmp_path / "out", pin, done))
    dist_info = f"{pin.name}-{pin.fork_version}.dist-info"
    assert built.keys() == fork_files.keys()
    package = [k for k in fork_files if not k.startswith(dist_info + "/")]
    assert [built[k] for k in package] == [fork_files[k] for k in package]
    metadata = f"{dist_info}/METADATA"
    _assert_the_companion_is_the_git_commit(built[metadata].decode(), fork_files[metadata].decode(), pin, repo_copy,
                                            commit)


def _uv() -> Optional[str]:
    found = Path(sys.executable).with_name("uv")
    return str(found) if found.is_file() else shutil.which("uv")


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.skipif(_uv() is None, reason="uv is not installed (requirements/test.txt installs it)")
def test_uv_pip_install_from_a_git_url(
    helpers, pin: Pin, upstream_wheel: Path, repo_copy: Path, fork_files: dict[str, bytes], tmp_path: Path
) -> None:
    """``uv pip install git+<repo>`` builds through the same backend and installs the same files as the wheel."""
    repo = repo_copy
    commit = helpers.commit_all(repo)
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
    site = next(venv.glob("lib/python*/site-packages"))
    expected, installed = ({row.split(",")[0]: row.split(",")[1] for row in text.splitlines()}
                           for text in (fork_files[f"{dist_info}/RECORD"].decode(),
                                        (site / dist_info / "RECORD").read_text()))
    # uv adds its own INSTALLER (and REQUESTED) files; everything from the wheel is installed unchanged, but for the
    # metadata's requirement on the companion: the URL given to uv (which its clone's FETCH_HEAD records), not uv's
    # clone in its cache (tests/tests_forkbuild/test_pinned_git_url.py: the lock that follows works anywhere)
    metadata = f"{dist_info}/METADATA"
    assert {k: v for k, v in installed.items() if k in expected and k != metadata} == {
        k: v for k, v in expected.items() if k != metadata
    }
    _assert_the_companion_is_the_git_commit((site / metadata).read_text(), fork_files[metadata].decode(), pin, repo,
                                            commit)


def test_sdist_holds_the_recipe_and_builds_the_same_wheel(
    helpers, pin: Pin, upstream_wheel: Path, upstream_files: dict[str, bytes], repo_copy: Path, fork_wheel: Path,
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
    helpers.same_wheel(fork_wheel, tmp_path / "out", pin, helpers.offline_build(sdist, tmp_path / "out",
                                                                                upstream_wheel))


# --- refusals ---------------------------------------------------------------------------------------------------------


def test_wheel_with_one_byte_changed_is_refused(helpers, pin: Pin, upstream_wheel: Path, tmp_path: Path) -> None:
    data = bytearray(upstream_wheel.read_bytes())
    data[len(data) // 2] ^= 0x01
    tampered = tmp_path / "in" / pin.filename
    tampered.parent.mkdir()
    tampered.write_bytes(bytes(data))
    actual = upstream.sha256_of(tampered)
    assert actual != pin.sha256

    done = helpers.offline_build(helpers.REPO, tmp_path / "out", tampered)
    helpers.refused(done, tmp_path / "out", "upstream.toml", f"expected sha256 {pin.sha256}",
                    f"actual sha256   {actual}")


def _add_patch(repo: Path, name: str, text: str) -> None:
    (repo / "patches" / name).write_text(text)
    series = repo / "patches" / "series"
    before = series.read_text() if series.is_file() else ""
    series.write_text(before + ("" if before.endswith("\n") or not before else "\n") + name + "\n")


def _clash(repo: Path) -> None:
    clash = repo / "src" / "lightning" / "__version__.py"
    clash.parent.mkdir(parents=True, exist_ok=True)
    clash.write_text("version = 'mine'\n")


@pytest.mark.parametrize(("breaks", "messages"), [
    pytest.param(lambda repo: _add_patch(
        repo, "9999-context-that-upstream-never-had.patch",
        "A patch written against a file that does not look like this.\n\n"
        "--- a/src/lightning/__version__.py\n+++ b/src/lightning/__version__.py\n"
        "@@ -1,3 +1,4 @@\n first line this file never had\n+an added line\n second such line\n third such line\n",
    ), ["patch 9999-context-that-upstream-never-had.patch does not apply to src/lightning/__version__.py"],
        id="broken-patch-naming-patch-and-file"),
    pytest.param(lambda repo: _add_patch(
        repo, "9998-ghost.patch", "--- a/src/lightning/ghost.py\n+++ b/src/lightning/ghost.py\n@@ -1 +1 @@\n-a\n+b\n"
    ), ["9998-ghost.patch", "src/lightning/ghost.py"], id="patch-for-a-file-upstream-lacks"),
    pytest.param(_clash, ["src/ would overwrite upstream files", "lightning/__version__.py"],
                 id="module-that-would-overwrite-upstream"),
])
def test_broken_inputs_are_refused(
    helpers, upstream_wheel: Path, upstream_files: dict[str, bytes], tmp_path: Path, breaks, messages: list[str]
) -> None:
    assert "lightning/__version__.py" in upstream_files
    repo = helpers.copy_build_inputs(tmp_path / "repo")
    breaks(repo)
    helpers.refused(helpers.offline_build(repo, tmp_path / "out", upstream_wheel), tmp_path / "out", *messages)


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
    done = helpers.offline_build(repo, tmp_path / "out", upstream_wheel)
    with zipfile.ZipFile(helpers.only_wheel(tmp_path / "out", pin, done)) as z:
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
