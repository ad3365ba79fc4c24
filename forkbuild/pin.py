"""The pin of the upstream release: ``upstream.toml`` at the repository root."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = ROOT / "upstream.toml"
_LINE = re.compile(r'^\s*([A-Za-z0-9_]+)\s*=\s*"([^"]*)"\s*$')
_SECTION = re.compile(r"^\s*\[([A-Za-z0-9_.-]+)\]\s*$")
_KEYS = ("name", "version", "filename", "sha256", "local")
#: the standalone distribution that ``lightning`` depends on: its own upstream wheel, the same patches and modules
STANDALONE = "pytorch-lightning"


class BuildError(Exception):
    """A build input is wrong; the message says which and what to do."""


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    filename: str
    sha256: str
    local: str
    path: Path

    @property
    def fork_version(self) -> str:
        """The fork's PEP 440 version: upstream's version with our local label, e.g. ``2.6.6+amp.1``."""
        return f"{self.version}+{self.local}"

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def project(self) -> str:
        """The name as wheel file names and ``.dist-info`` folders spell it (``pytorch-lightning`` -> ``pytorch_lightning``)."""
        return re.sub(r"[-_.]+", "_", self.name).lower()


def read_pin(path: Path = PIN_FILE, distribution: str = "lightning") -> Pin:
    """Read the ``key = "value"`` file (a TOML subset, so the build needs no TOML parser on Python 3.10).

    The top-level keys pin ``lightning``. A ``[<distribution>]`` table pins another upstream wheel of the same release
    (``[pytorch-lightning]``: its ``filename`` and ``sha256``); it inherits ``version`` and ``local``.
    """
    sections: dict[str, dict[str, str]] = {"": {}}
    section = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        header = _SECTION.match(line)
        if header is not None:
            section = header.group(1)
            sections.setdefault(section, {})
            continue
        match = _LINE.match(line)
        if match is None:
            raise BuildError(f'{path}:{number}: expected `key = "value"`, got {line!r}')
        sections[section][match.group(1)] = match.group(2)
    values = dict(sections[""])
    if distribution != values.get("name", "lightning"):
        if distribution not in sections:
            raise BuildError(f"{path}: no [{distribution}] table pins the upstream wheel of {distribution}")
        values.update(sections[distribution], name=distribution)
    missing = [key for key in _KEYS if key not in values]
    if missing:
        raise BuildError(f"{path}: missing {', '.join(missing)}")
    if not re.fullmatch(r"[0-9a-f]{64}", values["sha256"]):
        raise BuildError(f"{path}: sha256 must be 64 lowercase hex digits, got {values['sha256']!r}")
    if not re.fullmatch(r"[a-z0-9]+(\.[a-z0-9]+)*", values["local"]):
        raise BuildError(f"{path}: local must be a PEP 440 local label such as 'amp.1', got {values['local']!r}")
    return Pin(**{key: values[key] for key in _KEYS}, path=path)


def read_pins(path: Path = PIN_FILE) -> dict[str, Pin]:
    """Every pin of the file: ``lightning`` and the standalone ``pytorch-lightning``."""
    return {name: read_pin(path, name) for name in ("lightning", STANDALONE)}
