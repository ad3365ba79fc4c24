"""Assemble the fork's wheel: upstream's files, our modules laid over them, our patch series applied.

Everything happens in memory and the wheel is written to a temporary name and renamed at the end, so a failure
(bad hash, a patch that does not apply, a module that would overwrite an upstream file) never leaves a wheel behind.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
import zipfile
from pathlib import Path

from forkbuild.patching import Patch, apply_series, read_series
from forkbuild.pin import ROOT, BuildError, Pin

OVERLAY = ROOT / "src"
PATCHES = ROOT / "patches"
README = ROOT / "README.md"
_DATE = (2026, 1, 1, 0, 0, 0)  # fixed timestamps make the build reproducible
_SKIP = ("__pycache__", ".pyc", ".pyo")
SUMMARY = (
    "Lightning {version} patched for correct mixed-precision training (16-mixed / bf16-mixed, manual optimization,"
    " fused optimizers). A fork: the changes and the patch series are described below and in FORK.txt"
)


def overlay_files(root: Path = OVERLAY) -> dict[str, bytes]:
    """Our own modules, keyed by their path inside the wheel (``lightning/...``)."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not any(part in _SKIP or part.endswith(_SKIP) for part in path.relative_to(root).parts):
            files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files


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


def _metadata(upstream: bytes, pin: Pin, readme: str) -> bytes:
    """Upstream's METADATA with our version, a summary that says this is a fork, and our README as description."""
    head, _, _ = upstream.decode("utf-8").partition("\n\n")
    lines = []
    for line in head.splitlines():
        if line.startswith("Version: "):
            line = f"Version: {pin.fork_version}"
        elif line.startswith("Summary: "):
            line = "Summary: " + SUMMARY.format(version=pin.version)
        elif line.startswith("Description-Content-Type: "):
            line = "Description-Content-Type: text/markdown"
        lines.append(line)
    return ("\n".join(lines) + "\n\n" + readme).encode("utf-8")


def _fork_txt(pin: Pin, patches: list[Patch], overlay: dict[str, bytes]) -> bytes:
    out = [
        f"Fork of {pin.requirement} (wheel sha256 {pin.sha256}), version {pin.fork_version}.",
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


def fork_files(pin: Pin, upstream_wheel: Path) -> dict[str, bytes]:
    """Every file of the fork's wheel, RECORD included, in wheel order (the .dist-info folder last)."""
    files, upstream_dist_info = read_upstream(upstream_wheel)
    overlay = overlay_files()
    clashes = sorted(set(overlay) & set(files))
    if clashes:
        raise BuildError(
            f"src/ would overwrite upstream files {clashes}: change upstream files with a patch in patches/, never by"
            " laying a copy over them"
        )
    patches = apply_series(PATCHES, files)
    files.update(overlay)
    version_info = f"{pin.name}/version.info"
    if version_info not in files:
        raise BuildError(f"upstream wheel has no {version_info}; the fork cannot set its version")
    files[version_info] = (pin.fork_version + "\n").encode("ascii")

    dist_info = f"{pin.name}-{pin.fork_version}.dist-info"
    package = {k: v for k, v in files.items() if not k.startswith(upstream_dist_info + "/")}
    meta = {k[len(upstream_dist_info) + 1 :]: v for k, v in files.items() if k.startswith(upstream_dist_info + "/")}
    meta["METADATA"] = _metadata(meta["METADATA"], pin, README.read_text(encoding="utf-8"))
    meta["FORK.txt"] = _fork_txt(pin, patches, overlay)
    out = dict(sorted(package.items()))
    out.update({f"{dist_info}/{k}": v for k, v in sorted(meta.items())})
    record = [_record_line(name, data) for name, data in out.items()] + [f"{dist_info}/RECORD,,"]
    out[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode("utf-8")
    return out


def wheel_name(pin: Pin) -> str:
    return f"{pin.name}-{pin.fork_version}-py3-none-any.whl"


def _zip_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def write_wheel(pin: Pin, upstream_wheel: Path, directory: Path) -> Path:
    files = fork_files(pin, upstream_wheel)
    target = Path(directory) / wheel_name(pin)
    partial = target.with_name(target.name + ".part")
    with zipfile.ZipFile(partial, "w") as z:
        for name, data in files.items():
            z.writestr(_zip_info(name), data)
    os.replace(partial, target)
    return target


SDIST_MEMBERS = ("pyproject.toml", "upstream.toml", "README.md", "LICENSE", "forkbuild", "src", "patches")


def write_sdist(pin: Pin, directory: Path) -> Path:
    """A source distribution: the recipe (pin, our modules, patches, build tooling), never upstream's code."""
    base = f"{pin.name}-{pin.fork_version}"
    target = Path(directory) / f"{base}.tar.gz"
    partial = target.with_name(target.name + ".part")
    pkg_info = (
        f"Metadata-Version: 2.1\nName: {pin.name}\nVersion: {pin.fork_version}\n"
        f"Summary: {SUMMARY.format(version=pin.version)}\n"
    ).encode("utf-8")
    with tarfile.open(partial, "w:gz", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(f"{base}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 1767225600
            tar.addfile(info, io.BytesIO(data))

        add("PKG-INFO", pkg_info)
        for member in SDIST_MEMBERS:
            path = ROOT / member
            paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for p in paths:
                if not any(part in _SKIP or part.endswith(_SKIP) for part in p.relative_to(ROOT).parts):
                    add(p.relative_to(ROOT).as_posix(), p.read_bytes())
    os.replace(partial, target)
    return target


def series_names() -> list[str]:
    return [p.name for p in read_series(PATCHES)]
