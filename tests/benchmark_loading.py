"""Loading a script of benchmarks/ as a module, for the tests that check its helpers (benchmarks/ is no package)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (its folder on ``sys.path``, for the scripts' own imports).

    Example:
        >>> load_benchmark("gpu_common").__name__  # doctest: +SKIP
        'gpu_common'
    """
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec.loader.exec_module(module)
    return module
