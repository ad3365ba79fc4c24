"""Assemble the fork's wheels: upstream's files, our modules laid over them, our patch series applied.

Three flavours come out of the same inputs (:data:`FLAVOURS`):

* ``lightning``: the pinned ``lightning`` wheel, our modules (src/) and the series (patches/) as they are;
* ``pytorch-lightning``: the pinned standalone ``pytorch_lightning`` wheel (``pytorch_lightning/``,
  ``lightning_fabric/``), with the same modules and the same series renamed mechanically (forkbuild/rename.py), the
  way upstream generates its standalone packages; ``lightning`` pins it (``Requires-Dist``) so neither is installed
  beside a stock copy of the other without an error;
* ``stock-pytorch-lightning``: for the tests only, the standalone wheel *unpatched*, renamed to
  ``stock_pytorch_lightning``/``stock_lightning_fabric``, so the negative controls reach stock 2.6.6 beside the fork.

Everything happens in memory and the wheel is written to a temporary name and renamed at the end, so a failure
(bad hash, a patch that does not apply, a module that would overwrite an upstream file) never leaves a wheel behind.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from forkbuild.patching import Patch, apply_patch, apply_series, parse, read_series
from forkbuild.pin import ROOT, STANDALONE, BuildError, Pin, read_pin
from forkbuild.rename import STANDALONE as STANDALONE_RENAME
from forkbuild.rename import STOCK as STOCK_RENAME
from forkbuild.rename import Rename

OVERLAY = ROOT / "src"
PATCHES = ROOT / "patches"
README = ROOT / "README.md"
_DATE = (2026, 1, 1, 0, 0, 0)  # fixed timestamps make the build reproducible
_SKIP = ("__pycache__", ".pyc", ".pyo")
SUMMARY = (
    "Lightning {version} patched for correct mixed-precision training (16-mixed / bf16-mixed, manual optimization,"
    " fused optimizers). A fork: the changes and the patch series are described below and in FORK.txt"
)
STANDALONE_SUMMARY = (
    "PyTorch Lightning {version} (pytorch_lightning, lightning_fabric) with the patches of the `lightning` fork for"
    " correct mixed-precision training. A fork: see FORK.txt and the description below"
)
STOCK_SUMMARY = (
    "TEST ONLY: the unpatched pytorch-lightning {version}, renamed to stock_pytorch_lightning and"
    " stock_lightning_fabric, for the fork's negative controls, demo and benchmarks. Not for use"
)
STOCK = "stock-pytorch-lightning"
STOCK_DESCRIPTION = """\
# stock-pytorch-lightning {version} (test only)

The official, unpatched `pytorch_lightning` {version} wheel with its two packages renamed to `stock_pytorch_lightning`
and `stock_lightning_fabric` (every import and path, mechanically), so that the `lightning` fork's tests, demo and
benchmarks can run stock {version} in the same environment as the fork. Built by `python -m forkbuild wheel --flavour
stock-pytorch-lightning`; never install it for anything else.
"""


@dataclass(frozen=True)
class Flavour:
    """One wheel the inputs make: its distribution name, the upstream wheel it starts from, how paths are renamed."""

    name: str  # the distribution: lightning, pytorch-lightning, stock-pytorch-lightning
    upstream: str  # the pin (upstream.toml) of the wheel it starts from
    rename: Optional[Rename]  # lightning's layout -> this flavour's, for our modules and patches (None: as they are)
    patched: bool = True  # our modules and the series applied
    whole: Optional[Rename] = None  # every file of the upstream wheel renamed (the stock copy)
    summary: str = SUMMARY

    @property
    def project(self) -> str:
        return re.sub(r"[-_.]+", "_", self.name).lower()


FLAVOURS = {
    "lightning": Flavour("lightning", "lightning", None),
    STANDALONE: Flavour(STANDALONE, STANDALONE, STANDALONE_RENAME, summary=STANDALONE_SUMMARY),
    STOCK: Flavour(STOCK, STANDALONE, None, patched=False, whole=STOCK_RENAME, summary=STOCK_SUMMARY),
}


def flavour(name: Optional[str]) -> Flavour:
    key = (name or "lightning").strip()
    if key not in FLAVOURS:
        raise BuildError(f"unknown flavour {key!r}; one of {', '.join(FLAVOURS)}")
    return FLAVOURS[key]


def version_of(pin: Pin, flv: Flavour) -> str:
    return pin.fork_version if flv.patched else pin.version


def overlay_files(root: Path = OVERLAY, rename: Optional[Rename] = None) -> dict[str, bytes]:
    """Our own modules, keyed by their path inside the wheel (``lightning/...``, or renamed by ``rename``: modules
    outside the renamed packages are then left out, as upstream's standalone packages leave them out)."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not any(part in _SKIP or part.endswith(_SKIP) for part in path.relative_to(root).parts):
            files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files if rename is None else rename.files(files)[0]


def series(rename: Optional[Rename] = None, patch_dir: Optional[Path] = None) -> tuple[list[Patch], list[str]]:
    """The series, parsed, and renamed by ``rename``; with the patched paths that the renamed layout lacks."""
    patches, unmapped = [], []
    for path in read_series(patch_dir or PATCHES):
        patch = parse(path.name, path.read_bytes().decode("utf-8"))
        if rename is not None:
            patch, missing = rename.patch(patch)
            unmapped += missing
        patches.append(patch)
    return patches, unmapped


def read_upstream(wheel: Path) -> tuple[dict[str, bytes], str]:
    """Upstream's files (without its RECORD) and the name of its ``.dist-info`` folder."""
    with zipfile.ZipFile(wheel) as z:
        files = {info.filename: z.read(info) for info in z.infolist() if not info.is_dir()}
    dist_infos = {name.split("/", 1)[0] for name in files if name.split("/", 1)[0].endswith(".dist-info")}
    if len(dist_infos) != 1:
        raise BuildError(f"{wheel}: expected one .dist-info folder, found {sorted(dist_infos)}")
    dist_info = dist_infos.pop()
    files.pop(f"{dist_info}/RECORD", None)
    return files, dist_info


#: ``lightning``'s requirement on its standalone companion, which the fork replaces by a pin of the patched one
_COMPANION = re.compile(r"^Requires-Dist: pytorch-lightning\s*(;.*)?$")


def _metadata(upstream: bytes, pin: Pin, readme: str, flv: Optional[Flavour] = None,
              companion: Optional[str] = None) -> bytes:
    """Upstream's METADATA with our version, a summary that says this is a fork, and our README as description.

    ``lightning`` 2.6.6 requires ``pytorch-lightning`` (any version); the fork requires exactly the patched one
    (``pytorch-lightning==2.6.6+amp.1``), so that pip and uv refuse to pair it with a stock copy, or, given
    ``companion`` (a direct reference, forkbuild/companion.py), the patched one from where this build came from."""
    flv = flv or FLAVOURS["lightning"]
    head, _, _ = upstream.decode("utf-8").partition("\n\n")
    lines = []
    for line in head.splitlines():
        if line.startswith("Name: ") and flv.whole is not None:
            line = f"Name: {flv.name}"
        elif line.startswith("Version: "):
            line = f"Version: {version_of(pin, flv)}"
        elif line.startswith("Summary: "):
            line = "Summary: " + flv.summary.format(version=pin.version)
        elif line.startswith("Description-Content-Type: "):
            line = "Description-Content-Type: text/markdown"
        elif flv.name == "lightning" and _COMPANION.match(line):
            marker = _COMPANION.match(line).group(1) or ""
            line = f"Requires-Dist: {companion or f'{STANDALONE}=={pin.fork_version}'}{marker}"
        lines.append(line)
    return ("\n".join(lines) + "\n\n" + readme).encode("utf-8")


def _fork_txt(pin: Pin, patches: list[Patch], overlay: dict[str, bytes], flv: Optional[Flavour] = None,
              unmapped: tuple[str, ...] = ()) -> bytes:
    out = [
        f"Fork of {pin.requirement} (wheel sha256 {pin.sha256}), version {pin.fork_version}.",
    ]
    if flv is not None and flv.rename is not None:
        renames = ", ".join(f"{a} -> {b}" for a, b in flv.rename.packages)
        out += [f"The patches and modules of the lightning fork, renamed mechanically ({renames})."]
        if unmapped:
            out += ["Patched files of lightning that this distribution does not have (not applied here):"]
            out += [f"  {name}" for name in unmapped]
    out += [
        "",
        "Patches applied, in order:",
    ]
    for patch in patches:
        summary = next((ln.strip() for ln in patch.header.splitlines() if ln.strip()), "")
        out.append(f"  {patch.name}: {summary}")
        out.extend(f"      {fp.path}" for fp in patch.files)
    out += ["", "Modules of the fork's own (not in upstream):"]
    out += [f"  {name}" for name in sorted(overlay)]
    return ("\n".join(out) + "\n").encode("utf-8")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    return f"{name},sha256={digest},{len(data)}"


def _version_infos(flv: Flavour) -> list[str]:
    if flv.rename is None:
        return ["lightning/version.info"]
    return [f"{dst.replace('.', '/')}/version.info" for _, dst in flv.rename.packages]


def fork_files(pin: Pin, upstream_wheel: Path, flv: Optional[Flavour] = None,
               companion: Optional[str] = None,
               inputs: Optional[tuple[list[Patch], dict[str, bytes]]] = None) -> dict[str, bytes]:
    """Every file of the flavour's wheel (the fork's ``lightning`` by default), RECORD included, in wheel order (the
    .dist-info folder last). ``pin`` is the pin of the flavour's upstream wheel; ``companion`` replaces lightning's
    pin of ``pytorch-lightning`` (a direct reference, forkbuild/companion.py); ``inputs`` (patches and modules in
    lightning's layout) replace the series and src/ (the patched tree's edits: devtree.standalone_wheel)."""
    flv = flv or FLAVOURS["lightning"]
    files, upstream_dist_info = read_upstream(upstream_wheel)
    version = version_of(pin, flv)
    meta = {k[len(upstream_dist_info) + 1 :]: v for k, v in files.items() if k.startswith(upstream_dist_info + "/")}
    package = {k: v for k, v in files.items() if not k.startswith(upstream_dist_info + "/")}
    fork_txt = None
    if flv.whole is not None:  # the stock copy: everything renamed, nothing patched
        package, unmapped = flv.whole.files(package)
        if unmapped:
            raise BuildError(f"{upstream_wheel.name}: files outside the renamed packages: {unmapped}")
        meta = {k: flv.whole.data(v) if k == "top_level.txt" else v for k, v in meta.items()}
    if flv.patched:
        if inputs is None:
            overlay = overlay_files(rename=flv.rename)
            patches, unmapped = series(flv.rename)
        else:
            patches, unmapped = [], []
            for patch in inputs[0]:
                renamed, missing = flv.rename.patch(patch) if flv.rename is not None else (patch, [])
                patches.append(renamed)
                unmapped += missing
            overlay = inputs[1] if flv.rename is None else flv.rename.files(inputs[1])[0]
        clashes = sorted(set(overlay) & set(package))
        if clashes:
            raise BuildError(
                f"src/ would overwrite upstream files {clashes}: change upstream files with a patch in patches/, never"
                " by laying a copy over them"
            )
        for patch in patches:
            apply_patch(patch, package)
        package.update(overlay)
        for version_info in _version_infos(flv):
            if version_info not in package:
                raise BuildError(f"upstream wheel has no {version_info}; the fork cannot set its version")
            package[version_info] = (version + "\n").encode("ascii")
        fork_txt = _fork_txt(pin, patches, overlay, flv, tuple(unmapped))

    dist_info = f"{flv.project}-{version}.dist-info"
    readme = README.read_text(encoding="utf-8") if flv.patched else STOCK_DESCRIPTION.format(version=pin.version)
    meta["METADATA"] = _metadata(meta["METADATA"], pin, readme, flv, companion)
    if fork_txt is not None:
        meta["FORK.txt"] = fork_txt
    out = dict(sorted(package.items()))
    out.update({f"{dist_info}/{k}": v for k, v in sorted(meta.items())})
    record = [_record_line(name, data) for name, data in out.items()] + [f"{dist_info}/RECORD,,"]
    out[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode("utf-8")
    return out


def wheel_name(pin: Pin, flv: Optional[Flavour] = None) -> str:
    flv = flv or FLAVOURS.get(pin.name, FLAVOURS["lightning"])
    return f"{flv.project}-{version_of(pin, flv)}-py3-none-any.whl"


def _zip_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def write_wheel(pin: Pin, upstream_wheel: Path, directory: Path, flv: Optional[Flavour] = None,
                companion: Optional[str] = None,
                inputs: Optional[tuple[list[Patch], dict[str, bytes]]] = None) -> Path:
    flv = flv or FLAVOURS.get(pin.name, FLAVOURS["lightning"])
    files = fork_files(pin, upstream_wheel, flv, companion, inputs)
    target = Path(directory) / wheel_name(pin, flv)
    partial = target.with_name(target.name + ".part")
    with zipfile.ZipFile(partial, "w") as z:
        for name, data in files.items():
            z.writestr(_zip_info(name), data)
    os.replace(partial, target)
    return target


SDIST_MEMBERS = ("pyproject.toml", "upstream.toml", "README.md", "LICENSE", "forkbuild", "src", "patches", "packaging")
#: the standalone flavour's own build recipe (its pyproject and backend module), which its sdist has at the top
STANDALONE_RECIPE = ROOT / "packaging" / STANDALONE


def write_sdist(pin: Pin, directory: Path, flv: Optional[Flavour] = None) -> Path:
    """A source distribution: the recipe (pin, our modules, patches, build tooling), never upstream's code.

    The standalone flavour's sdist has its own pyproject.toml (packaging/pytorch-lightning's) at the top, beside
    the same recipe."""
    flv = flv or FLAVOURS.get(pin.name, FLAVOURS["lightning"])
    version = version_of(pin, flv)
    base = f"{flv.project}-{version}"
    target = Path(directory) / f"{base}.tar.gz"
    partial = target.with_name(target.name + ".part")
    pkg_info = (
        f"Metadata-Version: 2.1\nName: {flv.name}\nVersion: {version}\n"
        f"Summary: {flv.summary.format(version=pin.version)}\n"
    ).encode("utf-8")
    top: dict[str, bytes] = {}
    if flv.name != "lightning":
        top = {p.name: p.read_bytes() for p in sorted(STANDALONE_RECIPE.iterdir()) if p.is_file()
               and not p.name.endswith(_SKIP)}
    with tarfile.open(partial, "w:gz", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(f"{base}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 1767225600
            tar.addfile(info, io.BytesIO(data))

        add("PKG-INFO", pkg_info)
        for name, data in top.items():
            add(name, data)
        for member in SDIST_MEMBERS:
            path = ROOT / member
            paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for p in paths:
                name = p.relative_to(ROOT).as_posix()
                if name not in top and not any(part in _SKIP or part.endswith(_SKIP) for part in
                                               p.relative_to(ROOT).parts):
                    add(name, p.read_bytes())
    os.replace(partial, target)
    return target


def series_names() -> list[str]:
    return [p.name for p in read_series(PATCHES)]


def flavour_pin(flv: Flavour) -> Pin:
    return read_pin(distribution=flv.upstream)
