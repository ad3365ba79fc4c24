"""The second wheel, the fork's ``pytorch-lightning`` (``pytorch_lightning/``, ``lightning_fabric/``), and the tests'
``stock-pytorch-lightning``, checked the way test_wheel_contents checks ``lightning``: upstream's wheel, changed exactly
where the (renamed) patch series and our (renamed) modules say; reproducible; hash-checked.

The rename is checked on its own first: applied to upstream's ``lightning`` 2.6.6 wheel it must give upstream's
``pytorch_lightning`` 2.6.6 wheel byte for byte (that is how upstream generates its standalone packages), so a patch
written once against ``src/lightning/...`` applies to the standalone copy exactly where it applies to lightning's.
The package is then rebuilt independently of forkbuild's applier: the patch files with their paths and text renamed
by a regular expression here, applied by ``git apply`` to upstream's pytorch_lightning files.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import sys
import tarfile
from email.parser import Parser
from pathlib import Path

import pytest

from forkbuild import assemble
from forkbuild.patching import parse, read_series
from forkbuild.pin import Pin
from forkbuild.rename import STANDALONE, STOCK

#: files of the standalone wheel that the lightning wheel has no counterpart of (packaging leftovers, version files)
STANDALONE_ONLY = {
    f"{package}/{name}"
    for package in ("pytorch_lightning", "lightning_fabric")
    for name in ("__about__.py", "__setup__.py", "__version__.py", "py.typed", "version.info")
} | {"pytorch_lightning/MANIFEST.in", "pytorch_lightning/README.md"}
VERSION_INFOS = {"pytorch_lightning/version.info", "lightning_fabric/version.info"}


def _dist_info(pin: Pin) -> str:
    return f"pytorch_lightning-{pin.fork_version}.dist-info"


def _package(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if not k.split("/", 1)[0].endswith(".dist-info")}


def _meta(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k.split("/", 1)[1]: v for k, v in files.items() if k.split("/", 1)[0].endswith(".dist-info")}


def _rename_text(text: str) -> str:
    """The rename, written again here as one regular expression per package (an independent check of forkbuild's)."""
    text = re.sub(r"(?<![\w.])lightning\.pytorch(?!\w)", "pytorch_lightning", text)
    return re.sub(r"(?<![\w.])lightning\.fabric(?!\w)", "lightning_fabric", text)


# --- the rename is upstream's ---------------------------------------------------------------------------------------


def test_the_rename_turns_upstreams_lightning_into_upstreams_pytorch_lightning(
    upstream_files: dict[str, bytes], standalone_upstream_files: dict[str, bytes]
) -> None:
    renamed, unmapped = STANDALONE.files(_package(upstream_files))
    theirs = _package(standalone_upstream_files)
    assert all(name.startswith("lightning/") and name.count("/") == 1 or name.startswith("lightning/data/")
               for name in unmapped), unmapped  # lightning's own top-level files, which the standalone does not have
    assert set(theirs) - set(renamed) == STANDALONE_ONLY
    assert not set(renamed) - set(theirs)
    differing = sorted(name for name in renamed if renamed[name] != theirs[name])
    assert not differing
    assert len(renamed) > 250


def test_the_stock_rename_leaves_no_standalone_name(standalone_upstream_files: dict[str, bytes]) -> None:
    renamed, unmapped = STOCK.files(_package(standalone_upstream_files))
    assert not unmapped
    assert {name.split("/", 1)[0] for name in renamed} == {"stock_pytorch_lightning", "stock_lightning_fabric"}
    for name, data in renamed.items():
        text = data.decode("utf-8", errors="replace")
        assert not re.search(r"(?<![\w.])(pytorch_lightning|lightning_fabric)(?!\w)", text), name


# --- the standalone wheel: upstream's, changed only where the renamed series and modules say --------------------------


def test_wheel_name_version_and_dist_info(standalone_pin: Pin, standalone_wheel: Path,
                                          standalone_files: dict[str, bytes]) -> None:
    assert standalone_wheel.name == "pytorch_lightning-2.6.6+amp.1-py3-none-any.whl"
    assert {name.split("/", 1)[0] for name in standalone_files if ".dist-info/" in name} == {_dist_info(standalone_pin)}
    for name in VERSION_INFOS:
        assert standalone_files[name] == b"2.6.6+amp.1\n"


def test_record_lists_every_file_with_its_hash(helpers, standalone_pin: Pin,
                                               standalone_files: dict[str, bytes]) -> None:
    rows = list(csv.reader(io.StringIO(standalone_files[f"{_dist_info(standalone_pin)}/RECORD"].decode())))
    assert {row[0] for row in rows} == set(standalone_files)
    for name, digest, size in rows:
        data = standalone_files[name]
        assert name.endswith("/RECORD") or (digest, size) == (helpers.record_hash(data), str(len(data))), name


def test_every_difference_from_upstream_is_explained(
    repo_snapshot: Path, standalone_files: dict[str, bytes], standalone_upstream_files: dict[str, bytes]
) -> None:
    ours, theirs = _package(standalone_files), _package(standalone_upstream_files)
    own = assemble.overlay_files(repo_snapshot / "src", rename=STANDALONE)
    patched = set()
    for patch_file in read_series(repo_snapshot / "patches"):
        for file_patch in parse(patch_file.name, patch_file.read_text()).files:
            renamed = STANDALONE.path(file_patch.path[len("src/") :])
            if renamed is not None:
                patched.add(renamed)
    assert own and patched
    assert not set(theirs) - set(ours)
    assert set(ours) - set(theirs) == set(own)
    for name, data in own.items():
        assert ours[name] == data
    changed = {name for name in theirs if ours[name] != theirs[name]}
    assert not changed - patched - VERSION_INFOS
    assert patched <= changed  # every renamed patch changes its file here too


def test_the_standalone_package_is_lightnings_renamed(
    fork_files: dict[str, bytes], standalone_files: dict[str, bytes], standalone_upstream_files: dict[str, bytes]
) -> None:
    """One source of truth: the patched pytorch_lightning/lightning_fabric are the patched lightning.pytorch/
    lightning.fabric renamed, file for file; the rest is upstream's standalone files (version.info: the fork's)."""
    renamed, _ = STANDALONE.files(_package(fork_files))
    ours = _package(standalone_files)
    assert set(ours) == set(renamed) | STANDALONE_ONLY
    assert not [name for name in renamed if ours[name] != renamed[name]]
    for name in STANDALONE_ONLY - VERSION_INFOS:
        assert ours[name] == standalone_upstream_files[name]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_package_is_upstream_plus_the_series_renamed_and_applied_by_git(
    helpers, repo_snapshot: Path, standalone_files: dict[str, bytes], standalone_upstream_files: dict[str, bytes],
    tmp_path: Path,
) -> None:
    def renamed(text: str) -> bytes:
        text = re.sub(r"^(---|\+\+\+) ([ab])/src/lightning/pytorch/", r"\1 \2/src/pytorch_lightning/", text, flags=re.M)
        text = re.sub(r"^(---|\+\+\+) ([ab])/src/lightning/fabric/", r"\1 \2/src/lightning_fabric/", text, flags=re.M)
        head, sep, body = re.sub(r"^diff --git .*$", "", text, flags=re.M).partition("\n--- ")
        return (head + sep + _rename_text(body)).encode()

    patches = [(p.name, renamed(p.read_text())) for p in read_series(repo_snapshot / "patches")]
    expected = helpers.git_apply_series(_package(standalone_upstream_files), patches, tmp_path)
    for name, data in assemble.overlay_files(repo_snapshot / "src").items():
        target = STANDALONE.path(name)
        if target is not None:
            expected[target] = _rename_text(data.decode()).encode()
    for name in VERSION_INFOS:
        expected[name] = b"2.6.6+amp.1\n"
    ours = _package(standalone_files)
    assert sorted(ours) == sorted(expected)
    assert not [name for name in expected if ours[name] != expected[name]]


def test_dist_info_and_metadata(standalone_pin: Pin, repo_snapshot: Path, standalone_files: dict[str, bytes],
                                standalone_upstream_files: dict[str, bytes]) -> None:
    ours, theirs = _meta(standalone_files), _meta(standalone_upstream_files)
    assert set(ours) == set(theirs) | {"FORK.txt"}
    for name in set(theirs) - {"METADATA", "RECORD"}:
        assert ours[name] == theirs[name], name
    mine, upstream_meta = Parser().parsestr(ours["METADATA"].decode()), Parser().parsestr(theirs["METADATA"].decode())
    assert (mine["Name"], mine["Version"]) == ("pytorch-lightning", "2.6.6+amp.1")
    assert "fork" in mine["Summary"].lower()
    assert mine.get_all("Requires-Dist") == upstream_meta.get_all("Requires-Dist")  # upstream's dependencies
    changed = {"Version", "Summary", "Description-Content-Type"}
    assert [kv for kv in mine.items() if kv[0] not in changed] == [kv for kv in upstream_meta.items()
                                                                   if kv[0] not in changed]
    assert mine.get_payload().strip() == (repo_snapshot / "README.md").read_text().strip()
    fork_txt = ours["FORK.txt"].decode()
    assert standalone_pin.sha256 in fork_txt and "lightning.pytorch -> pytorch_lightning" in fork_txt
    for patch_file in read_series(repo_snapshot / "patches"):
        assert patch_file.name in fork_txt


# --- building it: reproducible, from git with a subdirectory, from its sdist; hash-checked -----------------------------


@pytest.mark.parametrize("route", ["recipe-folder", "flavour-setting", "git-subdirectory"])
def test_every_route_builds_the_same_standalone_wheel(helpers, standalone_pin: Pin, upstream_wheel: Path,
                                                      upstream_dir: Path, standalone_wheel: Path, repo_copy: Path,
                                                      tmp_path: Path, route: str) -> None:
    """The same bytes from another copy at another path (the upstream folder, not a file, as the setting, but from
    git): from the recipe's folder; from the root with ``--config-settings flavour=pytorch-lightning``; what ``pip
    install "git+URL#subdirectory=packaging/pytorch-lightning"`` builds (pip < 24 refuses the named form,
    ``pytorch-lightning @ git+file:///...``, for a file:// URL without a host; the README's https URLs take both)."""
    source, settings, wheels = repo_copy / helpers.STANDALONE_RECIPE, None, upstream_dir
    if route == "flavour-setting":
        source, settings = repo_copy, {"flavour": "pytorch-lightning"}
    elif route == "git-subdirectory":
        if shutil.which("git") is None:
            pytest.skip("git is not installed")
        helpers.commit_all(repo_copy)
        source = f"git+{repo_copy.as_uri()}#subdirectory={helpers.STANDALONE_RECIPE.as_posix()}"
        wheels = upstream_wheel
    done = helpers.offline_build(source, tmp_path / "out", wheels, config_settings=settings)
    helpers.same_wheel(standalone_wheel, tmp_path / "out", standalone_pin, done)


def test_sdist_holds_the_recipe_and_builds_the_same_wheel(helpers, standalone_pin: Pin, upstream_wheel: Path,
                                                           standalone_upstream_files: dict[str, bytes],
                                                           standalone_wheel: Path, repo_copy: Path,
                                                           tmp_path: Path) -> None:
    code = ("import sys; sys.path.insert(0, 'packaging/pytorch-lightning'); import _forkbuild_backend as b;"
            " print(b.build_sdist(sys.argv[1]))")
    (tmp_path / "sdist").mkdir()
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sdist")],
                          cwd=repo_copy, capture_output=True, text=True, env=helpers.base_env())
    assert done.returncode == 0, done.stderr
    sdist = tmp_path / "sdist" / done.stdout.strip()
    assert sdist.name == "pytorch_lightning-2.6.6+amp.1.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers()}
        pyproject = tar.extractfile(f"{sdist.name[: -len('.tar.gz')]}/pyproject.toml").read()
    assert pyproject == (repo_copy / helpers.STANDALONE_RECIPE / "pyproject.toml").read_bytes()
    assert {"PKG-INFO", "_forkbuild_backend.py", "upstream.toml", "forkbuild/backend.py", "patches/series"} <= names
    assert not {n for n in names if n.split("/", 1)[0] in ("pytorch_lightning", "lightning_fabric", "lightning")}
    done = helpers.offline_build(sdist, tmp_path / "out", upstream_wheel)
    helpers.same_wheel(standalone_wheel, tmp_path / "out", standalone_pin, done)


def test_a_tampered_pytorch_lightning_wheel_is_refused(helpers, standalone_pin: Pin, upstream_wheel: Path,
                                                        standalone_upstream_wheel: Path, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy2(upstream_wheel, folder / upstream_wheel.name)  # lightning's is fine
    data = bytearray(standalone_upstream_wheel.read_bytes())
    data[len(data) // 3] ^= 0x01
    (folder / standalone_pin.filename).write_bytes(bytes(data))
    recipe = helpers.REPO / helpers.STANDALONE_RECIPE
    done = helpers.offline_build(recipe, tmp_path / "out", folder / upstream_wheel.name)
    helpers.refused(done, tmp_path / "out", f"expected sha256 {standalone_pin.sha256}", standalone_pin.filename)


def test_a_patch_that_does_not_apply_stops_the_standalone_build_too(helpers, upstream_wheel: Path,
                                                                     tmp_path: Path) -> None:
    repo = helpers.copy_build_inputs(tmp_path / "repo")
    target = "src/lightning/pytorch/core/module.py"
    (repo / "patches" / "9999-stale.patch").write_text(
        f"Why: a test.\n\n--- a/{target}\n+++ b/{target}\n@@ -1,2 +1,3 @@\n no such line\n+added\n nor this one\n"
    )
    with open(repo / "patches" / "series", "a") as f:
        f.write("9999-stale.patch\n")
    done = helpers.offline_build(repo / helpers.STANDALONE_RECIPE, tmp_path / "out", upstream_wheel)
    helpers.refused(done, tmp_path / "out",
                    "patch 9999-stale.patch does not apply to src/pytorch_lightning/core/module.py")


# --- the tests' stock copy --------------------------------------------------------------------------------------------


def test_stock_wheel_is_upstreams_renamed(helpers, stock_wheel: Path,
                                          standalone_upstream_files: dict[str, bytes]) -> None:
    ours = helpers.wheel_files(stock_wheel)
    renamed, _ = STOCK.files(_package(standalone_upstream_files))
    assert _package(ours) == renamed  # nothing patched, nothing added
    meta = _meta(ours)
    assert set(meta) == set(_meta(standalone_upstream_files))
    metadata = Parser().parsestr(meta["METADATA"].decode())
    assert (metadata["Name"], metadata["Version"]) == ("stock-pytorch-lightning", "2.6.6")
    assert "TEST ONLY" in metadata["Summary"]
    assert meta["top_level.txt"] == b"stock_lightning_fabric\nstock_pytorch_lightning\n"


def test_stock_wheel_is_reproducible(helpers, upstream_dir: Path, stock_wheel: Path, repo_copy: Path,
                                     tmp_path: Path) -> None:
    assert helpers.build_stock(repo_copy, upstream_dir, tmp_path / "out").read_bytes() == stock_wheel.read_bytes()

