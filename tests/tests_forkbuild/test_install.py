"""The built wheels in a clean virtual environment: the fork's ``lightning`` and ``pytorch-lightning`` install together,
import (``import pytorch_lightning`` and ``lightning_fabric`` get the fixes too), pass ``pip check`` and uninstall
cleanly; ``lightning`` refuses a stock ``pytorch-lightning`` beside it, and a package that depends on
``pytorch-lightning`` does not replace the patched one; checkpoints travel between the fork and stock 2.6.6
(``stock_pytorch_lightning``, the tests' renamed copy, installed beside it).

One virtual environment for the module (``python -m venv``, then torch and the wheel with its dependencies from the
configured index): slow (about a minute, mostly torch), but part of the default run.

What ``lightning.__version__`` reports, decided: upstream's version with the fork's PEP 440 local label
(``2.6.6+amp.1``). Checkpoints record it as ``pytorch-lightning_version``. Stock 2.6.6 loads such a checkpoint,
warning that it comes from a newer Lightning (``2.6.6+amp.1 > 2.6.6`` in PEP 440) and skipping its migrations, of
which there are none to run between equal release numbers; the fork loads stock checkpoints as upstream does.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from forkbuild import upstream
from forkbuild.pin import Pin

pytestmark = pytest.mark.slow

TORCH = "torch==2.13.0"


@dataclass
class Venv:
    root: Path
    python: Path
    site_packages: Path
    workdir: Path  # the current directory for every command: nothing importable lies there
    env: dict[str, str]

    def run(self, *args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.python), "-I", *args], cwd=self.workdir, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check:
            assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
        return done

    def pip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("-m", "pip", *args, check=check)

    def scripts(self, code: str, *runs: tuple[str, ...]) -> list[dict]:
        """Run CODE once per argument tuple, all at once; each run prints one JSON line last: return them parsed."""
        path = self.workdir / f"script{len(list(self.workdir.glob('script*.py')))}.py"
        path.write_text(textwrap.dedent(code))
        procs = [
            subprocess.Popen([str(self.python), "-I", str(path), *args], cwd=self.workdir, env=self.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args in runs
        ]
        results = []
        for args, proc in zip(runs, procs):
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{args}\n{out}\n{err}"
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results

    def script(self, code: str, *args: str) -> dict:
        return self.scripts(code, args)[0]

    def listing(self) -> set[str]:
        """Every file and folder (folders with a trailing slash) of the environment."""
        out = set()
        for folder, dirs, files in os.walk(self.root):
            rel = Path(folder).relative_to(self.root)
            out.update(f"{(rel / d).as_posix()}/" for d in dirs)
            out.update((rel / f).as_posix() for f in files)
        return out

    def record(self, dist_info: str) -> dict[str, tuple[str, str]]:
        """The installed RECORD: path relative to the environment -> (hash, size)."""
        text = (self.site_packages / dist_info / "RECORD").read_text()
        rows = {}
        for name, digest, size in csv.reader(io.StringIO(text)):
            path = Path(os.path.normpath(self.site_packages / name))
            rows[path.relative_to(self.root).as_posix()] = (digest, size)
        return rows


@pytest.fixture(scope="module")
def venv(helpers, fork_wheel: Path, standalone_wheel: Path, stock_wheel: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Venv:
    base = tmp_path_factory.mktemp("clean-venv")
    root = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True)
    python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    env = helpers.base_env(VIRTUAL_ENV=None, PIP_REQUIRE_VIRTUALENV=None)
    env["PYTHONNOUSERSITE"] = "1"
    (base / "work").mkdir()
    purelib = subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    env_ = Venv(root, python, Path(purelib), base / "work", env)
    env_.pip("install", "--no-compile", TORCH)  # torch is not what is under test: skip compiling its byte code
    # both distributions of the fork in one command (lightning pins its companion), and the tests' stock copy
    env_.pip("install", str(fork_wheel), str(standalone_wheel), str(stock_wheel))
    return env_  # pytest's tmp_path rotation removes it (deleting a gigabyte of torch here would only add time)


def test_imports_as_the_fork(venv: Venv, pin: Pin, repo_snapshot: Path) -> None:
    own = sorted(
        ".".join(p.relative_to(repo_snapshot / "src").with_suffix("").parts).removesuffix(".__init__")
        for p in (repo_snapshot / "src").rglob("*.py") if "__pycache__" not in p.parts
    )
    result = venv.script(
        """
        import importlib, importlib.metadata, json, sys
        import lightning
        from lightning.pytorch import Trainer
        import lightning.fabric, lightning.pytorch, pytorch_lightning, lightning_fabric
        import stock_pytorch_lightning, stock_lightning_fabric
        for name in sys.argv[1:]:  # the fork's own modules, under both import names
            importlib.import_module(name)
            importlib.import_module(name.replace("lightning.pytorch", "pytorch_lightning").replace(
                "lightning.fabric", "lightning_fabric"))
        print(json.dumps({
            "version": lightning.__version__,
            "pytorch": lightning.pytorch.__version__,
            "fabric": lightning.fabric.__version__,
            "distribution": importlib.metadata.version("lightning"),
            "file": lightning.__file__,
            "trainer": Trainer.__module__,
            "standalone": pytorch_lightning.__version__,
            "standalone_fabric": lightning_fabric.__version__,
            "standalone_distribution": importlib.metadata.version("pytorch-lightning"),
            "standalone_file": pytorch_lightning.__file__,
            "stock": [stock_pytorch_lightning.__version__, stock_lightning_fabric.__version__],
            "stock_distribution": importlib.metadata.version("stock-pytorch-lightning"),
        }))
        """,
        *own,
    )
    assert result["version"] == result["pytorch"] == result["fabric"] == result["distribution"] == "2.6.6+amp.1"
    assert result["version"] == pin.fork_version
    assert Path(result["file"]).is_relative_to(venv.site_packages)
    assert result["trainer"].startswith("lightning.pytorch.")
    assert result["standalone"] == result["standalone_fabric"] == result["standalone_distribution"] == pin.fork_version
    assert Path(result["standalone_file"]).is_relative_to(venv.site_packages)
    assert result["stock"] == [pin.version, pin.version]  # the tests' unpatched copy
    assert result["stock_distribution"] == pin.version


def test_import_pytorch_lightning_alone_gets_the_fix(venv: Venv) -> None:
    """``import pytorch_lightning`` / ``lightning_fabric`` load the patched standalone packages, not ``lightning``: the
    fork's recipe is there under the standalone names (the behaviour itself: tests_pytorch/test_standalone_packages)."""
    result = venv.script(
        """
        import json, sys
        import pytorch_lightning as pl
        from lightning_fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
        from pytorch_lightning.callbacks import LossScaleMonitor
        from pytorch_lightning.plugins.precision import MixedPrecision
        print(json.dumps({
            "lightning_loaded": sorted(m for m in sys.modules if m == "lightning" or m.startswith("lightning.")),
            "mro": [c.__module__ for c in MixedPrecision.__mro__],
            "fabric_mro": [c.__module__ for c in FabricMixedPrecision.__mro__],
            "monitor": LossScaleMonitor.__module__,
        }))
        """
    )
    assert result["lightning_loaded"] == []
    assert "pytorch_lightning.plugins.precision.amp_recipe" in result["mro"]
    assert "lightning_fabric.plugins.precision.amp_recipe_precision" in result["fabric_mro"]
    assert not [m for m in result["mro"] + result["fabric_mro"] if m.startswith("lightning.")]
    assert result["monitor"] == "pytorch_lightning.callbacks.loss_scale_monitor"


def test_pip_check(venv: Venv) -> None:
    done = venv.pip("check", check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("which", ["fork_wheel", "standalone_wheel", "stock_wheel"])
def test_installed_files_are_the_wheels(request, helpers, venv: Venv, which: str) -> None:
    wheel = request.getfixturevalue(which)
    project, version = wheel.name.split("-")[:2]
    installed = venv.record(f"{project}-{version}.dist-info")
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                continue
            rel = (venv.site_packages / info.filename).relative_to(venv.root).as_posix()
            data = z.read(info)
            assert installed[rel] == (helpers.record_hash(data), str(len(data))), rel
            assert (venv.root / rel).read_bytes() == data, rel


CHECKPOINT_SCRIPT = """
    import json, sys, warnings
    import torch

    package, mode, path, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if package == "fork":
        import lightning.pytorch as pl
        from lightning.pytorch.demos.boring_classes import BoringModel
    else:
        import stock_pytorch_lightning as pl
        from stock_pytorch_lightning.demos.boring_classes import BoringModel

    class Restored(pl.Callback):
        # the weights and step the resumed run starts from are the checkpoint's
        seen = None

        def on_train_start(self, trainer, module):
            if mode != "resume":
                return
            saved = torch.load(path, weights_only=False)
            same = all(torch.equal(v, saved["state_dict"][k]) for k, v in module.state_dict().items())
            Restored.seen = {"weights": same and module.state_dict().keys() == saved["state_dict"].keys(),
                             "step": trainer.global_step}

    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Restored()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel(), ckpt_path=path if mode == "resume" else None)
    if mode == "save":
        trainer.save_checkpoint(path)
    print(json.dumps({
        "running": pl.__version__,
        "saved_by": torch.load(path, weights_only=False)["pytorch-lightning_version"],
        "global_step": trainer.global_step,
        "start": Restored.seen,
        "warnings": [str(w.message) for w in caught],
    }))
"""


def test_checkpoints_travel_between_the_fork_and_stock(venv: Venv, pin: Pin) -> None:
    def runs(*specs: tuple[str, str, str, int]) -> list[dict]:  # the two directions run side by side
        return venv.scripts(CHECKPOINT_SCRIPT, *[(pkg, mode, str(venv.workdir / name), str(n)) for pkg, mode, name, n
                                                 in specs])

    fork_saved, stock_saved = runs(("fork", "save", "fork.ckpt", 2), ("stock", "save", "stock.ckpt", 2))
    assert fork_saved["running"] == fork_saved["saved_by"] == pin.fork_version == "2.6.6+amp.1"
    assert fork_saved["global_step"] == 2
    assert stock_saved["running"] == stock_saved["saved_by"] == "2.6.6"

    stock_resumed, fork_resumed = runs(("stock", "resume", "fork.ckpt", 4), ("fork", "resume", "stock.ckpt", 4))
    # stock Lightning resumes the fork's checkpoint: same weights, same step, then trains on
    assert stock_resumed["running"] == "2.6.6"
    assert stock_resumed["start"] == {"weights": True, "step": 2}
    assert stock_resumed["global_step"] == 4
    newer = [w for w in stock_resumed["warnings"] if "newer than your current Lightning version" in w]
    assert newer and "v2.6.6+amp.1" in newer[0]  # the documented consequence of the local version: a warning
    # and the fork resumes stock's
    assert fork_resumed["running"] == pin.fork_version
    assert fork_resumed["start"] == {"weights": True, "step": 2}
    assert fork_resumed["global_step"] == 4
    assert not [w for w in fork_resumed["warnings"] if "newer than" in w]


@pytest.mark.parametrize(("distribution", "which"), [("lightning", "fork_wheel"), ("pytorch-lightning", "standalone_wheel")])
def test_uninstall_removes_exactly_what_was_installed(request, venv: Venv, pin: Pin, distribution: str,
                                                      which: str) -> None:
    wheel = request.getfixturevalue(which)
    dist_info = f"{distribution.replace('-', '_')}-{pin.fork_version}.dist-info"
    venv.pip("uninstall", "-y", distribution)
    before = venv.listing()
    assert not (venv.site_packages / dist_info).exists()

    venv.pip("install", "--no-deps", str(wheel))  # alone: its dependencies are all there
    installed = venv.listing()
    record = venv.record(dist_info)
    new_files = {p for p in installed - before if not p.endswith("/")}
    assert new_files == set(record), sorted(new_files ^ set(record))[:20]

    venv.pip("uninstall", "-y", distribution)
    after = venv.listing()
    assert not [p for p in record if (venv.root / p).exists()], "files of the RECORD survived the uninstall"
    assert after == before, {"left": sorted(after - before)[:20], "removed": sorted(before - after)[:20]}

    venv.pip("install", "--no-deps", str(wheel))  # leave the environment as the other tests found it


# --- the two distributions stay together ------------------------------------------------------------------------------


def _wheel(sha, folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A minimal wheel of an empty distribution that requires ``requires``."""
    project = name.replace("-", "_")
    dist_info = f"{project}-{version}.dist-info"
    files = {
        f"{dist_info}/METADATA": "".join(
            [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"] + [f"Requires-Dist: {r}\n" for r in requires]
        ).encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{k},{sha(v)},{len(v)}" for k, v in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{project}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def _installed_version(venv: Venv, distribution: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    return venv.run("-c", code).stdout.strip()


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_a_package_that_depends_on_pytorch_lightning_keeps_the_patched_one(
    helpers, venv: Venv, pin: Pin, standalone_upstream_wheel: Path, installer: str
) -> None:
    """A third-party package requiring ``pytorch-lightning`` (any version, or ``==2.6.6``, which PEP 440 lets the
    local version ``2.6.6+amp.1`` satisfy), from an index that also offers the stock 2.6.6 wheel: the patched one
    stays, byte for byte."""
    index = venv.workdir / f"index-{installer}"
    _wheel(helpers.record_hash, index, "needs-any-pl", "1.0", ["pytorch-lightning>=2.0"])
    _wheel(helpers.record_hash, index, "needs-pl-266", "1.0", ["pytorch-lightning==2.6.6"])
    (index / standalone_upstream_wheel.name).write_bytes(standalone_upstream_wheel.read_bytes())
    record_before = venv.record(f"pytorch_lightning-{pin.fork_version}.dist-info")
    args = ("install", "--no-index", "--find-links", str(index), "needs-any-pl", "needs-pl-266")
    if installer == "pip":
        venv.pip(*args)
    else:
        done = subprocess.run([_uv_or_skip(), "pip", *args, "--python", str(venv.python)], env=venv.env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    try:
        assert _installed_version(venv, "pytorch-lightning") == pin.fork_version
        assert venv.record(f"pytorch_lightning-{pin.fork_version}.dist-info") == record_before
        venv.pip("check")
    finally:
        venv.pip("uninstall", "-y", "needs-any-pl", "needs-pl-266")


# --- the README's install command, from a git URL ---------------------------------------------------------------------


def _offline(helpers, venv: Venv, upstream_dir: Path, tmp_path: Path) -> dict[str, str]:
    """The venv's environment without any index (everything but the fork is installed already), the upstream wheels
    from a folder."""
    env = dict(venv.env)
    env.update(helpers.offline_env(**{upstream.ENV_VAR: str(upstream_dir), "UV_CACHE_DIR": str(tmp_path / "uv")}))
    env.pop("VIRTUAL_ENV", None)
    return env


def _uv_or_skip() -> str:
    uv = Path(sys.executable).with_name("uv")
    if not uv.is_file():
        pytest.skip("uv is not installed (requirements/test.txt installs it)")
    return str(uv)


def _installed_metadata(venv: Venv, distribution: str) -> list[str]:
    code = f"import importlib.metadata as m; print(*m.requires({distribution!r}), sep='\\n')"
    return venv.run("-c", code).stdout.splitlines()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("installer", ["pip", "newest-pip", "uv"])
def test_one_git_url_installs_both(request, helpers, venv: Venv, pin: Pin, upstream_dir: Path, fork_wheel: Path,
                                   standalone_wheel: Path, tmp_path: Path, installer: str) -> None:
    """``pip install git+URL`` (the venv's pip 23.2.1 and the newest) and ``uv pip install git+URL``: built in the
    installer's clone, lightning names its companion from the same URL and commit (forkbuild/companion.py), so one
    URL installs both patched distributions."""
    commit = helpers.commit_all(helpers.copy_build_inputs(tmp_path / "repo"))
    url = f"git+{(tmp_path / 'repo').as_uri()}"
    env = _offline(helpers, venv, upstream_dir, tmp_path)
    venv.pip("uninstall", "-y", "lightning", "pytorch-lightning")
    try:
        if installer == "uv":
            command = [_uv_or_skip(), "pip", "install", "--offline", "--python", str(venv.python), url]
        else:
            pip = [str(request.getfixturevalue("newest_pip") / "pip")] if installer == "newest-pip" else ["-m", "pip"]
            command = [str(venv.python), "-I", *pip, "install", "--no-compile", "--no-cache-dir", url]
        done = subprocess.run(command, cwd=venv.workdir, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        assert _installed_version(venv, "lightning") == _installed_version(venv, "pytorch-lightning") == pin.fork_version
        companion = [r for r in _installed_metadata(venv, "lightning") if r.startswith("pytorch-lightning")]
        assert len(companion) == 1 and companion[0].startswith("pytorch-lightning @ git+file://"), companion
        assert companion[0].endswith(f"@{commit}#subdirectory={helpers.STANDALONE_RECIPE.as_posix()}"), companion
        venv.pip("check")
    finally:
        venv.pip("install", "--no-deps", "--no-compile", "--force-reinstall", str(fork_wheel), str(standalone_wheel))


def test_a_stock_pytorch_lightning_beside_the_fork_is_an_error(
    helpers, venv: Venv, pin: Pin, upstream_dir: Path, standalone_upstream_wheel: Path, fork_wheel: Path,
    standalone_wheel: Path, tmp_path: Path
) -> None:
    """1. Replacing the patched pytorch-lightning by stock 2.6.6 (asking for that very file: for a requirement by name
    pip and uv keep the installed ``2.6.6+amp.1``, which every 2.6.6 requirement accepts) is reported at once, and by
    ``pip check``. 2. The fork's lightning wheel without its companion, where stock pytorch-lightning 2.6.6 is
    installed: pip refuses, naming the patched companion it needs, and changes nothing. (From a git URL, lightning
    brings its companion: test_one_git_url_installs_both.)"""
    env = _offline(helpers, venv, upstream_dir, tmp_path)
    expected = f"pytorch-lightning=={pin.fork_version}, but you have pytorch-lightning {pin.version}"
    try:
        done = venv.pip("install", "--no-compile", str(standalone_upstream_wheel))
        assert f"lightning {pin.fork_version} requires {expected}" in done.stdout + done.stderr, done.stdout
        check = venv.pip("check", check=False)
        assert check.returncode != 0 and f"lightning {pin.fork_version} has requirement {expected}" in check.stdout

        venv.pip("uninstall", "-y", "lightning")
        done = subprocess.run([str(venv.python), "-I", "-m", "pip", "install", str(fork_wheel)], cwd=venv.workdir,
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode != 0
        assert f"pytorch-lightning=={pin.fork_version}" in done.stdout + done.stderr, done.stdout + done.stderr
        assert _installed_version(venv, "pytorch-lightning") == pin.version  # nothing replaced, nothing half-done
        assert venv.run("-c", "import importlib.util as u; print(u.find_spec('lightning'))").stdout.strip() == "None"
    finally:
        venv.pip("install", "--no-deps", "--no-compile", "--force-reinstall", str(fork_wheel), str(standalone_wheel))
    venv.pip("check")
