"""The fork's wheel is upstream's wheel, changed exactly where the patch series and our own modules say.

Everything here looks at the wheel built by pip from this repository and at the pinned upstream wheel, and rebuilds
what the package should hold without forkbuild's applier (with ``git apply``), so a bug there cannot hide itself.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from email.parser import Parser
from pathlib import Path

import pytest

from forkbuild.patching import parse, read_series
from forkbuild.pin import Pin

_CACHES = ("__pycache__", ".pyc", ".pyo")


def _dist_info(pin: Pin) -> str:
    return f"{pin.name}-{pin.fork_version}.dist-info"


def _upstream_dist_info(pin: Pin) -> str:
    return f"{pin.name}-{pin.version}.dist-info"


def _own_modules(repo: Path) -> dict[str, bytes]:
    """src/lightning/... in the repository -> lightning/... in the wheel."""
    src = repo / "src"
    return {
        path.relative_to(src).as_posix(): path.read_bytes()
        for path in sorted(src.rglob("*"))
        if path.is_file() and not any(part == "__pycache__" or part.endswith(_CACHES) for part in
                                      path.relative_to(src).parts)
    }


def _patched_paths(repo: Path) -> set[str]:
    paths = set()
    for patch_file in read_series(repo / "patches"):
        for file_patch in parse(patch_file.name, patch_file.read_text()).files:
            assert file_patch.path.startswith("src/"), file_patch.path
            paths.add(file_patch.path[len("src/") :])
    return paths


def _package(files: dict[str, bytes], dist_info: str) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if not k.startswith(dist_info + "/")}


def _record(files: dict[str, bytes], dist_info: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(files[f"{dist_info}/RECORD"].decode())))


def _metadata(data: bytes):
    return Parser().parsestr(data.decode())


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=cwd,
                          capture_output=True)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout.decode()


def _insert_after(text: str, line_number: int, added: str) -> str:
    lines = text.splitlines(keepends=True)
    lines.insert(line_number, added)
    return "".join(lines)


def _with_extras(
    helpers, pin: Pin, upstream_wheel: Path, upstream_files: dict[str, bytes], root: Path
) -> tuple[Path, Path]:
    """A copy of the build inputs with two more patches (made with git diff, the second on top of the first and one
    touching two files) and one more module of our own; returns the copy and the wheel pip builds from it."""
    repo = helpers.copy_build_inputs(root / "repo")
    base = {name: upstream_files[name].decode() for name in ("lightning/fabric/fabric.py", "lightning/__about__.py")}
    work = root / "work"
    (work / "src").mkdir(parents=True)
    _git(work, "init", "-q")
    for name, text in base.items():
        (work / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (work / "src" / name).write_bytes(text.encode())
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", "upstream")
    fabric = work / "src" / "lightning/fabric/fabric.py"
    fabric.write_text(_insert_after(base["lightning/fabric/fabric.py"], 40, "# first extra patch\n"))
    first = _git(work, "diff")
    _git(work, "commit", "-q", "-am", "first")
    fabric.write_text(fabric.read_text().replace("# first extra patch\n", "# first, then second extra patch\n"))
    about = work / "src" / "lightning/__about__.py"
    about.write_text(_insert_after(base["lightning/__about__.py"], 3, "# second extra patch\n"))
    second = _git(work, "diff")
    series = repo / "patches" / "series"
    (repo / "patches" / "9001-extra-first.patch").write_text("Why: a test of the series.\n\n" + first)
    (repo / "patches" / "9002-extra-second.patch").write_text("Why: on top of 9001.\n\n" + second)
    series.write_text(series.read_text() + "9001-extra-first.patch\n9002-extra-second.patch\n")
    module = repo / "src" / "lightning" / "pytorch" / "_extra_module_for_tests.py"
    module.parent.mkdir(parents=True, exist_ok=True)
    module.write_text("EXTRA = True\n")
    return repo, helpers.only_wheel(root / "out", pin, helpers.offline_build(repo, root / "out", upstream_wheel))


@pytest.fixture(scope="module", params=["this-repository", "copy-with-extra-patches"])
def built(request, helpers, pin: Pin, upstream_wheel: Path, upstream_files: dict[str, bytes], tmp_path_factory):
    """(build inputs, the wheel's files): this repository's wheel, and one built from a copy with more in it, so the
    checks below see a series and own modules of known content whatever the state of the repository's own."""
    if request.param == "this-repository":
        repo, wheel = request.getfixturevalue("repo_snapshot"), request.getfixturevalue("fork_wheel")
    else:
        if shutil.which("git") is None:
            pytest.skip("git is not installed")
        repo, wheel = _with_extras(helpers, pin, upstream_wheel, upstream_files, tmp_path_factory.mktemp("extras"))
    files = helpers.wheel_files(wheel)
    if request.param != "this-repository":  # the extras are there, both patches applied in order
        assert b"\n# first, then second extra patch\n" in files["lightning/fabric/fabric.py"]
        assert b"\n# second extra patch\n" in files["lightning/__about__.py"]
        assert files["lightning/pytorch/_extra_module_for_tests.py"] == b"EXTRA = True\n"
    return repo, files


# --- naming, RECORD ---------------------------------------------------------------------------------------------------


def test_wheel_name_and_dist_info(pin: Pin, fork_wheel: Path, fork_files: dict[str, bytes]) -> None:
    assert fork_wheel.name == f"lightning-{pin.fork_version}-py3-none-any.whl"
    assert pin.fork_version == "2.6.6+amp.1"
    assert {name.split("/", 1)[0] for name in fork_files if ".dist-info/" in name} == {_dist_info(pin)}
    assert fork_files["lightning/version.info"] == f"{pin.fork_version}\n".encode()


def test_record_lists_every_file_with_its_hash_and_size(helpers, pin: Pin, built) -> None:
    _, fork_files = built
    rows = _record(fork_files, _dist_info(pin))
    assert all(len(row) == 3 for row in rows), [row for row in rows if len(row) != 3]
    names = [row[0] for row in rows]
    assert len(names) == len(set(names)), "RECORD names a file twice"
    assert set(names) == set(fork_files), set(names) ^ set(fork_files)
    for name, digest, size in rows:
        if name == f"{_dist_info(pin)}/RECORD":
            assert (digest, size) == ("", "")
            continue
        data = fork_files[name]
        assert (digest, size) == (helpers.record_hash(data), str(len(data))), name


# --- the package: upstream's except where the series and our modules say ----------------------------------------------


def test_every_difference_from_upstream_is_explained(pin: Pin, built, upstream_files: dict[str, bytes]) -> None:
    repo, fork_files = built
    ours, theirs = _package(fork_files, _dist_info(pin)), _package(upstream_files, _upstream_dist_info(pin))
    own = _own_modules(repo)
    patched = _patched_paths(repo)

    assert not set(theirs) - set(ours), "upstream files missing from the fork"
    assert set(ours) - set(theirs) == set(own), "new files that are not our own modules under src/"
    for name, data in own.items():
        assert ours[name] == data, f"{name} differs from src/{name}"
    changed = {name for name in theirs if ours[name] != theirs[name]}
    unexplained = changed - patched - {"lightning/version.info"}
    assert not unexplained, f"changed, but no patch in the series touches them: {sorted(unexplained)}"
    assert "lightning/version.info" in changed


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_package_is_upstream_plus_series_applied_by_git_plus_own_modules(
    helpers, pin: Pin, built, upstream_files: dict[str, bytes], tmp_path: Path
) -> None:
    """Rebuild the package independently: upstream's files in upstream's layout, ``git apply`` each patch of the
    series in order, lay src/ over it, set version.info; the wheel must hold exactly that."""
    repo, fork_files = built
    patches = [(p.name, p.read_bytes()) for p in read_series(repo / "patches")]
    expected = helpers.git_apply_series(_package(upstream_files, _upstream_dist_info(pin)), patches, tmp_path)
    expected.update(_own_modules(repo))
    expected["lightning/version.info"] = f"{pin.fork_version}\n".encode()

    ours = _package(fork_files, _dist_info(pin))
    assert sorted(ours) == sorted(expected)
    differing = [name for name in expected if ours[name] != expected[name]]
    assert not differing


# --- dist-info --------------------------------------------------------------------------------------------------------


def test_dist_info_is_upstreams_plus_fork_txt(pin: Pin, built, upstream_files: dict[str, bytes]) -> None:
    _, fork_files = built
    ours = {k.split("/", 1)[1]: v for k, v in fork_files.items() if k.startswith(_dist_info(pin) + "/")}
    theirs = {k.split("/", 1)[1]: v for k, v in upstream_files.items() if k.startswith(_upstream_dist_info(pin) + "/")}
    assert set(ours) == set(theirs) | {"FORK.txt"}
    for name in set(theirs) - {"METADATA", "RECORD"}:  # WHEEL, entry points, top_level, the license: unchanged
        assert ours[name] == theirs[name], name
    assert b"Root-Is-Purelib: true" in ours["WHEEL"] and b"Tag: py3-none-any" in ours["WHEEL"]


def test_fork_txt_names_the_pin_every_patch_and_every_own_module(pin: Pin, built) -> None:
    repo, fork_files = built
    text = fork_files[f"{_dist_info(pin)}/FORK.txt"].decode()
    assert pin.sha256 in text and pin.fork_version in text
    for patch_file in read_series(repo / "patches"):
        assert patch_file.name in text
    for name in _own_modules(repo):
        assert name in text


def test_metadata(pin: Pin, built, upstream_files: dict[str, bytes]) -> None:
    repo, fork_files = built
    ours = _metadata(fork_files[f"{_dist_info(pin)}/METADATA"])
    theirs = _metadata(upstream_files[f"{_upstream_dist_info(pin)}/METADATA"])
    assert ours["Name"] == "lightning"
    assert ours["Version"] == "2.6.6+amp.1"
    assert "fork" in ours["Summary"].lower()
    assert ours["Summary"] != theirs["Summary"]
    # dependencies are upstream's, line for line and in order, but for the companion: upstream requires any
    # pytorch-lightning, the fork exactly its own patched one
    companion = f"pytorch-lightning=={pin.fork_version}"
    assert theirs.get_all("Requires-Dist").count("pytorch-lightning") == 1
    assert ours.get_all("Requires-Dist") == [companion if r == "pytorch-lightning" else r
                                             for r in theirs.get_all("Requires-Dist")]
    assert companion == "pytorch-lightning==2.6.6+amp.1"
    assert ours.get_all("Provides-Extra") == theirs.get_all("Provides-Extra")
    # and so is every other field (the description aside)
    changed = {"Version", "Summary", "Description-Content-Type", "Requires-Dist"}
    assert [kv for kv in ours.items() if kv[0] not in changed] == [kv for kv in theirs.items() if kv[0] not in changed]
    assert ours["Description-Content-Type"] == "text/markdown"
    assert ours.get_payload().strip() == (repo / "README.md").read_text().strip()
