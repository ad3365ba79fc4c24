"""Mechanical renaming of packages, in paths and in text: how the standalone ``pytorch_lightning`` gets the fork.

Upstream writes its code once, under ``src/lightning/`` (``lightning.pytorch``, ``lightning.fabric``), and generates
the standalone packages ``pytorch_lightning`` and ``lightning_fabric`` from it by renaming imports and paths
(``.actions/assistant.py`` there). The fork does the same with its patches and modules: one source of truth, mapped
by :data:`STANDALONE`. The rule reproduces upstream's generation exactly: renaming every file of the official
``lightning`` 2.6.6 wheel under ``lightning/pytorch/`` and ``lightning/fabric/`` gives, byte for byte, the files of the
official ``pytorch_lightning`` 2.6.6 wheel (``tests/tests_forkbuild`` checks it), so a patch applies to the renamed
file exactly where it applies to the original.

:data:`STOCK` renames the unpatched ``pytorch_lightning``/``lightning_fabric`` to ``stock_pytorch_lightning``/
``stock_lightning_fabric``: a test-only package through which the tests, the demo and the benchmarks reach stock
2.6.6 beside the fork.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from forkbuild.patching import FilePatch, Hunk, Patch


@dataclass(frozen=True)
class Rename:
    #: (source module, target module), e.g. ("lightning.pytorch", "pytorch_lightning")
    packages: tuple[tuple[str, str], ...]
    #: upstream's base-package rule, per target package: ``from lightning import X`` -> ``from <base> import X``
    base: dict[str, str] = field(default_factory=dict)

    def _patterns(self) -> list[tuple[re.Pattern, str]]:
        return [(re.compile(r"(?<![\w.])" + re.escape(src) + r"(?!\w)"), dst) for src, dst in self.packages]

    def path(self, path: str) -> Optional[str]:
        """``lightning/pytorch/core/module.py`` -> ``pytorch_lightning/core/module.py``; None where no package maps."""
        for src, dst in self.packages:
            prefix = src.replace(".", "/") + "/"
            if path.startswith(prefix):
                return dst.replace(".", "/") + "/" + path[len(prefix) :]
        return None

    def target(self, path: str) -> Optional[str]:
        """The target package that a (renamed) path lies in."""
        for _, dst in self.packages:
            if path.startswith(dst.replace(".", "/") + "/"):
                return dst
        return None

    def line(self, line: str, target: Optional[str] = None) -> str:
        for pattern, dst in self._patterns():
            line = pattern.sub(dst, line)
        base = self.base.get(target or "")
        if base:
            line = line.replace("from lightning import ", f"from {base} import ")
            line = line.replace("import lightning ", f"import {base} ")
        return line

    def text(self, text: str, target: Optional[str] = None) -> str:
        """Rename inside ``text``, line by line (so a patch's hunks map exactly as the file they apply to)."""
        return "".join(self.line(ln, target) for ln in text.splitlines(keepends=True))

    def data(self, data: bytes, target: Optional[str] = None) -> bytes:
        """Rename inside a file's bytes; files that are not UTF-8 text are left as they are."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return data
        return self.text(text, target).encode("utf-8")

    def files(self, files: dict[str, bytes]) -> tuple[dict[str, bytes], list[str]]:
        """Rename a wheel-layout mapping (``lightning/...`` -> content): (renamed files, paths that map nowhere)."""
        out, unmapped = {}, []
        for name, data in files.items():
            renamed = self.path(name)
            if renamed is None:
                unmapped.append(name)
            else:
                out[renamed] = self.data(data, self.target(renamed))
        return out, unmapped

    def patch(self, patch: Patch, prefix: str = "src/") -> tuple[Patch, list[str]]:
        """The patch with its paths and hunk lines renamed; returns it and the paths it touches that map nowhere
        (files the renamed layout does not have, e.g. ``src/lightning/__init__.py`` for ``pytorch_lightning``)."""
        files, unmapped = [], []
        for file_patch in patch.files:
            inner = file_patch.path[len(prefix) :] if file_patch.path.startswith(prefix) else None
            renamed = self.path(inner) if inner is not None else None
            if renamed is None:
                unmapped.append(file_patch.path)
                continue
            target = self.target(renamed)
            hunks = [
                Hunk(h.header, h.old_start, [self.line(x, target) for x in h.old], [self.line(x, target) for x in h.new])
                for h in file_patch.hunks
            ]
            files.append(FilePatch(prefix + renamed, hunks))
        return Patch(patch.name, patch.header, files), unmapped


#: lightning's layout -> the standalone pytorch-lightning distribution's (``pytorch_lightning``, ``lightning_fabric``)
STANDALONE = Rename(
    (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric")),
    # upstream's generator maps the base package this way (`from lightning import __version__` becomes
    # `from lightning.pytorch import __version__` in pytorch_lightning/__init__.py): kept, to reproduce its files
    base={"pytorch_lightning": "lightning.pytorch", "lightning_fabric": "lightning_fabric"},
)

#: the unpatched standalone packages -> the test-only stock copy
STOCK = Rename((("pytorch_lightning", "stock_pytorch_lightning"), ("lightning_fabric", "stock_lightning_fabric")))
