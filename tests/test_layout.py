"""Public names never share their name with a submodule (issue 11, item 1).

Importing a submodule binds it as an attribute of its package, so a public function named like a
submodule (``memwrap.wrap`` next to ``memwrap/wrap.py``) turns into a module as soon as anything
imports that submodule, in whatever order. The layout test checks the cause for every package;
the subprocess test replays the reported sequence and every first-access order.
"""
from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types

import pytest

import memwrap

PACKAGES = ["memwrap", "memwrap.memory", "memwrap.models", "memwrap.integrations"]


def _public(package: types.ModuleType) -> list[str]:
    if hasattr(package, "__all__"):
        return list(package.__all__)
    # Without __all__, the public names are what the package defines itself, not submodules bound as attributes.
    return [n for n, v in vars(package).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)]


@pytest.mark.parametrize("name", PACKAGES)
def test_no_public_name_is_also_a_submodule(name):
    package = importlib.import_module(name)
    submodules = {info.name for info in pkgutil.iter_modules(package.__path__)}
    clash = sorted(set(_public(package)) & submodules)
    assert not clash, f"{name}: public names {clash} are also submodules; rename the submodule"


def test_every_public_name_survives_importing_every_submodule():
    for info in pkgutil.walk_packages(memwrap.__path__, "memwrap."):
        if info.name.endswith(("integrations.lightning", "integrations.transformers", ".cli", ".demo")):
            continue  # optional dependencies; they cannot rebind a core name anyway (checked above)
        importlib.import_module(info.name)
    for name in PACKAGES:
        package = importlib.import_module(name)
        for public in _public(package):
            value = getattr(package, public)
            assert not isinstance(value, types.ModuleType), f"{name}.{public} became a module"


@pytest.mark.parametrize("first", sorted(set(memwrap.__all__)))
def test_first_access_order_keeps_wrap_callable(first):
    # The reported failure: in a fresh process, memwrap.unwrap (or backward) before memwrap.wrap.
    code = (
        "import types, memwrap, torch\n"
        f"getattr(memwrap, {first!r})\n"
        "bad = [n for n in memwrap.__all__ if isinstance(getattr(memwrap, n), types.ModuleType)]\n"
        "assert not bad, bad\n"
        "m = memwrap.wrap(torch.nn.Linear(2, 2))\n"
        "assert memwrap.unwrap(m) is not m\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
