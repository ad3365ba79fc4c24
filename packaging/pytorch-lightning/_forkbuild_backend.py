"""The build backend of the standalone ``pytorch-lightning``: the repository's ``forkbuild.backend``, flavour
``pytorch-lightning``. (PEP 517 keeps ``backend-path`` inside this folder, so this module finds the repository's
build tooling two folders up, or beside it in an sdist.)"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = next((p for p in (_HERE, *_HERE.parents) if (p / "forkbuild" / "backend.py").is_file()), None)
if _ROOT is None:
    raise ImportError(f"{_HERE}: the fork's build tooling (forkbuild/) is not in this folder or above it")
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from forkbuild.backend import hooks  # noqa: E402

# build_wheel, build_sdist, build_editable and their get_requires_for_* hooks, flavour pytorch-lightning
globals().update(vars(hooks("pytorch-lightning")))
