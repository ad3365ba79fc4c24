"""The README's pinned install lines work as printed: ``pip install "lightning @ git+URL@<commit>"`` (the form of
requirements files) and ``uv add "lightning @ git+URL@<commit>"``, whose ``uv.lock`` works anywhere. The commit the
README pins is one of this repository's history (an ancestor of HEAD: tags made in a working copy may not travel to the
repository's ``main``, so the README names none), and the fork builds from it.

pip builds a named requirement in ``pip-install-*/lightning_<hex>`` (not in ``pip-req-build-*`` as for a bare URL);
the wheel built there must name its companion by the same URL and commit, or pip finds no ``pytorch-lightning``.

``uv add "lightning @ git+URL"`` builds ``lightning`` in uv's own clone of the URL, and ``lightning`` requires its
companion ``pytorch-lightning`` from the same repository and commit (forkbuild/companion.py). That requirement must
name the URL the user gave, not uv's cache folder: a ``uv.lock`` that pins the companion to
``<uv cache>/git-v*/db/<id>`` fails ``uv sync --locked`` on a teammate's machine, in CI, and here after
``uv cache clean``. So the test adds the fork to a fresh project, clears the cache, and syncs a copy of the project in
another folder with another (empty) cache, offline.

The project overrides the fork's index dependencies (torch, torchmetrics, ...) away with a marker that is never true:
they come from a package index, which any lock records portably, and leaving them out keeps the test offline and
fast (a few seconds: two pure-Python builds and no torch).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from forkbuild import upstream
from forkbuild.pin import ROOT, Pin

#: lightning's and pytorch-lightning's dependencies from the package index, overridden away (see the docstring)
INDEX_DEPENDENCIES = (
    "torch", "torchmetrics", "fsspec", "lightning-utilities", "pyyaml", "tqdm", "packaging", "typing-extensions",
)  # fmt: skip


def _uv() -> Optional[str]:
    found = Path(sys.executable).with_name("uv")
    return str(found) if found.is_file() else shutil.which("uv")


pytestmark = [
    pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed"),
    pytest.mark.skipif(_uv() is None, reason="uv is not installed (requirements/test.txt installs it)"),
]


def readme_pins(readme: Path = ROOT / "README.md") -> list[str]:
    """The refs the README's install lines pin (``lightning @ git+<repository URL>@<ref>``), in order."""
    section = readme.read_text(encoding="utf-8").partition("\n## Install\n")[2].partition("\n## ")[0]
    return re.findall(r'"lightning @ git\+<repository URL>@([^"\s]+)"', section)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _pinned_commit_of_this_repository() -> str:
    """The commit the README pins, checked to be in this repository's history (skips outside a full git clone)."""
    pins = readme_pins()
    assert pins and len(set(pins)) == 1, f"the README's install lines pin {pins}: one commit, the same in each form"
    commit = pins[0]
    assert re.fullmatch(r"[0-9a-f]{40}", commit), f"the README pins {commit!r}, not a full commit hash"
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip(f"{ROOT} is not a full git clone: the pinned commit's history cannot be checked")
    assert _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0, f"the README pins {commit}: no such commit"
    is_ancestor = _git("merge-base", "--is-ancestor", commit, "HEAD").returncode
    assert is_ancestor == 0, f"the README pins {commit}, which is not in HEAD's history"
    return commit


def test_the_readme_pins_a_commit_of_this_repositorys_history() -> None:
    _pinned_commit_of_this_repository()


def _assert_builds_naming_its_companion(helpers, pin: Pin, upstream_dir: Path, out: Path, url: str, commit: str,
                                        pip: tuple[str, ...] = ("-m", "pip")) -> None:
    """pip builds ``lightning @ URL@COMMIT`` offline, and the wheel requires its companion at the same URL and
    commit (one such requirement)."""
    done = helpers.offline_build(f"lightning @ {url}@{commit}", out, upstream_dir, pip=pip)
    files = helpers.wheel_files(helpers.only_wheel(out, pin, done))
    metadata = files[f"{pin.name}-{pin.fork_version}.dist-info/METADATA"].decode()
    companion = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: pytorch-lightning")]
    assert companion == [f"Requires-Dist: pytorch-lightning @ {url}@{commit}#subdirectory=packaging/pytorch-lightning"]


def test_the_readmes_commit_builds(helpers, pin: Pin, upstream_dir: Path, tmp_path: Path) -> None:
    """pip, as the README's first line runs it, at the README's commit of this repository (offline)."""
    url = "git+file://localhost" + ROOT.as_posix()
    _assert_builds_naming_its_companion(helpers, pin, upstream_dir, tmp_path / "out", url,
                                        _pinned_commit_of_this_repository())


def _project(folder: Path) -> Path:
    folder.mkdir(parents=True)
    overrides = ", ".join(f'"{name}; python_version < \'0\'"' for name in INDEX_DEPENDENCIES)
    (folder / "pyproject.toml").write_text(
        '[project]\nname = "app"\nversion = "0"\nrequires-python = ">=3.10"\ndependencies = []\n\n'
        f"[tool.uv]\noverride-dependencies = [{overrides}]\n",
        encoding="utf-8",
    )
    return folder


@pytest.mark.parametrize("installer", ["pip", "newest-pip"])
def test_pip_named_requirement_at_a_commit(
    request, helpers, pin: Pin, upstream_dir: Path, tmp_path: Path, installer: str
) -> None:
    commit = helpers.commit_all(helpers.copy_build_inputs(tmp_path / "repo"))
    url = "git+file://localhost" + (tmp_path / "repo").as_posix()  # the form pip 23 accepts for a local path
    # the test environment's pip, or the newest one, run from its wheel
    pip = ("-m", "pip") if installer == "pip" else (str(request.getfixturevalue("newest_pip") / "pip"),)
    _assert_builds_naming_its_companion(helpers, pin, upstream_dir, tmp_path / "out", url, commit, pip)


def _uv_run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([_uv(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"uv {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _installed(project: Path, distribution: str) -> str:
    python = project / ".venv" / "bin" / "python"
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("at_commit", [False, True], ids=["url", "url-at-commit"])
def test_uv_lock_names_the_given_url_and_syncs_after_the_cache_is_gone(
    helpers, pin: Pin, upstream_dir: Path, tmp_path: Path, at_commit: bool
) -> None:
    commit = helpers.commit_all(helpers.copy_build_inputs(tmp_path / "repo"))
    ref = f"@{commit}" if at_commit else ""
    url = (tmp_path / "repo").as_uri()  # file:///...: what a user's https URL is to uv and git
    env = helpers.offline_env(**{upstream.ENV_VAR: str(upstream_dir), "UV_CACHE_DIR": str(tmp_path / "cache")})
    env.update(UV_PYTHON_DOWNLOADS="never", UV_NO_CONFIG="1")
    env.pop("VIRTUAL_ENV", None)

    mine = _project(tmp_path / "mine")
    _uv_run(["add", "--offline", "--no-sync", "--python", sys.executable, f"lightning @ git+{url}{ref}"], mine, env)
    lock = (mine / "uv.lock").read_text(encoding="utf-8")
    assert "git-v" not in lock and str(tmp_path / "cache") not in lock, lock
    companion = f'source = {{ git = "{url}?subdirectory=packaging%2Fpytorch-lightning&rev={commit}#{commit}" }}'
    assert companion in lock, lock

    # a teammate: the project as committed (pyproject.toml and uv.lock), another folder, an empty cache
    _uv_run(["cache", "clean"], mine, env)
    theirs = _project(tmp_path / "theirs")
    shutil.copy2(mine / "pyproject.toml", theirs / "pyproject.toml")
    shutil.copy2(mine / "uv.lock", theirs / "uv.lock")
    env["UV_CACHE_DIR"] = str(tmp_path / "cache-of-a-teammate")
    _uv_run(["sync", "--locked", "--offline", "--python", sys.executable], theirs, env)
    assert _installed(theirs, "lightning") == _installed(theirs, "pytorch-lightning") == pin.fork_version
    # what `uv pip freeze` writes for requirements files names the URL too
    frozen = _uv_run(["pip", "freeze", "--python", str(theirs / ".venv" / "bin" / "python")], theirs, env).stdout
    assert f"pytorch-lightning @ git+{url}@{commit}#subdirectory=packaging/pytorch-lightning" in frozen, frozen
    assert "git-v" not in frozen, frozen
    assert (theirs / "uv.lock").read_text(encoding="utf-8") == lock  # --locked: unchanged
