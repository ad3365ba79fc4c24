"""The benchmarks' scripts (``benchmarks/*.py``, not a package) imported by the tests of this folder."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py``, with ``benchmarks/`` on the path while it imports its siblings."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
