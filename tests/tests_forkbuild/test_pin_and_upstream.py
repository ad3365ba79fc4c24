"""The pin (upstream.toml) and how the build finds and verifies the upstream wheel (forkbuild.pin, forkbuild.upstream);
and the rule that the repository holds no upstream code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forkbuild import upstream
from forkbuild.pin import BuildError, Pin, read_pin

GOOD = {
    "name": "lightning",
    "version": "2.6.6",
    "filename": "lightning-2.6.6-py3-none-any.whl",
    "sha256": "0" * 64,
    "local": "amp.1",
}


def _pin_file(tmp_path: Path, **changes: str | None) -> Path:
    values = {**GOOD, **changes}
    lines = ["# a comment", ""] + [f'{k} = "{v}"' for k, v in values.items() if v is not None]
    path = tmp_path / "upstream.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_repositorys_pin(pin: Pin, upstream_wheel: Path) -> None:
    assert (pin.name, pin.version, pin.local) == ("lightning", "2.6.6", "amp.1")
    assert pin.fork_version == "2.6.6+amp.1"
    assert pin.requirement == "lightning==2.6.6"
    assert pin.path.name == "upstream.toml"
    assert upstream.sha256_of(upstream_wheel) == pin.sha256


def test_read_pin(tmp_path: Path) -> None:
    pin = read_pin(_pin_file(tmp_path, local="fork.7"))
    assert pin.fork_version == "2.6.6+fork.7"
    assert pin.path == tmp_path / "upstream.toml"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sha256": None}, "missing sha256"),
        ({"sha256": "ABC"}, "sha256 must be 64 lowercase hex digits"),
        ({"sha256": "A" * 64}, "sha256 must be 64 lowercase hex digits"),
        ({"local": "amp+1"}, "local must be a PEP 440 local label"),
        ({"local": ""}, "local must be a PEP 440 local label"),
    ],
)
def test_read_pin_refuses(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(BuildError, match=message):
        read_pin(_pin_file(tmp_path, **changes))


def test_read_pin_refuses_a_line_it_cannot_read(tmp_path: Path) -> None:
    path = _pin_file(tmp_path)
    path.write_text(path.read_text() + "version = 2.6.6\n")
    with pytest.raises(BuildError, match=r"upstream.toml:\d+: expected"):
        read_pin(path)


def test_local_source_setting_wins_over_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(upstream.ENV_VAR, raising=False)
    assert upstream.local_source({}) is None
    assert upstream.local_source(None) is None
    monkeypatch.setenv(upstream.ENV_VAR, str(tmp_path / "from-env"))
    assert upstream.local_source({}) == tmp_path / "from-env"
    assert upstream.local_source({upstream.CONFIG_SETTING: str(tmp_path / "from-setting")}) == tmp_path / "from-setting"
    monkeypatch.setenv(upstream.ENV_VAR, "")
    assert upstream.local_source({}) is None


@pytest.mark.parametrize("as_folder", [False, True])
def test_obtain_a_local_file_or_folder(pin: Pin, upstream_wheel: Path, tmp_path: Path, as_folder: bool) -> None:
    source = upstream_wheel.parent if as_folder else upstream_wheel
    got = upstream.obtain(pin, tmp_path, {upstream.CONFIG_SETTING: str(source)})
    assert got == upstream_wheel
    assert not list(tmp_path.iterdir()), "a local source must not be downloaded again"


def test_obtain_from_a_folder_without_the_wheel(pin: Pin, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(BuildError) as err:
        upstream.obtain(pin, tmp_path, {upstream.CONFIG_SETTING: str(tmp_path / "empty")})
    message = str(err.value)
    assert str(tmp_path / "empty" / pin.filename) in message
    assert f"pip download {pin.requirement} --no-deps --only-binary=:all:" in message


def test_verify_names_pin_file_and_both_hashes(pin: Pin, upstream_wheel: Path, tmp_path: Path) -> None:
    assert upstream.verify(pin, upstream_wheel) == upstream_wheel
    other = tmp_path / pin.filename
    other.write_bytes(upstream_wheel.read_bytes() + b"\0")
    with pytest.raises(BuildError) as err:
        upstream.verify(pin, other)
    message = str(err.value)
    assert "upstream.toml" in message
    assert pin.sha256 in message
    assert upstream.sha256_of(other) in message


def test_the_repository_holds_no_upstream_code(helpers, upstream_wheel: Path) -> None:
    tool = helpers.REPO.parent / "shared" / "tools" / "upstream_overlap.py"
    if not tool.is_file():
        pytest.skip(
            "the check that no upstream code was copied into the repository needs the copy detector"
            f" `upstream_overlap.py`, a tool of the fork's maintainers that a clone of this repository does not have"
            f" (looked for at {tool})"
        )
    done = subprocess.run([sys.executable, str(tool), "--repo", str(helpers.REPO), "--wheel", str(upstream_wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
