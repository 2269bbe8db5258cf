"""The package's layout: public names never share their name with a submodule (issue 11, item 1); the import graph
has no circle, no folder holds a ``<concern>_<part>.py`` prefix family, and every package is in the wheel (issue 19).

Importing a submodule binds it as an attribute of its package, so a public function named like a
submodule (``memwrap.wrap`` next to ``memwrap/wrap.py``) turns into a module as soon as anything
imports that submodule, in whatever order. The layout test checks the cause for every package;
the subprocess test replays the reported sequence and every first-access order.
"""
from __future__ import annotations

import ast
import collections
import importlib
import pathlib
import pkgutil
import subprocess
import sys
import tomllib
import types

import pytest

import memwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = sorted(info.name for info in pkgutil.walk_packages(memwrap.__path__, "memwrap.") if info.ispkg) + ["memwrap"]
# Old import paths kept as thin re-exports (docs/changelog.md); they are not part of the layering.
SHIMS = {"memwrap.registry", "memwrap.plugins", "memwrap.hookspecs"}


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


# --- the import graph (issue 19) ---------------------------------------------------------------------------------

def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in ((ROOT / "memwrap", "memwrap"), (ROOT / "plugins", "memwrap_plugins")):
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_graph(inside_functions: bool = True) -> dict[str, set[str]]:
    """Every memwrap import, at module level or inside a function (those count too: a lazy import that closes a
    circle is still a circle), except under ``if TYPE_CHECKING:``. ``inside_functions=False``: only the imports
    that run when the module is imported."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = collections.defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def walk(node: ast.AST) -> None:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                return
            if not inside_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in filter(None, map(resolve, targets)):
                if target != name:
                    graph[name].add(target)
            for child in ast.iter_child_nodes(node):
                walk(child)

        walk(ast.parse(path.read_text()))
    return graph


def test_the_import_graph_has_no_circle():
    graph = _import_graph()
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(_modules()):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles (move the shared piece below both):\n" + "\n".join(circles)


def test_at_most_eight_import_floors():
    # A floor: a module's height in the graph of the imports that run at import time (a module importing only
    # outside memwrap is on floor 1). Before the layout work the package stood on 12.
    graph = _import_graph(inside_functions=False)
    floors: dict[str, list[str]] = {}

    def climb(name: str) -> list[str]:
        if name not in floors:
            floors[name] = [name, *max((climb(t) for t in graph[name]), key=len, default=[])]
        return floors[name]

    tallest = max((climb(name) for name in _modules()), key=len)
    assert len(tallest) <= 8, f"{len(tallest)} import floors: " + " -> ".join(tallest)


def test_no_folder_holds_a_prefix_family():
    # `budget_plan.py` next to `budget_apply.py` (or next to `budget.py`) is a folder wanting to exist.
    families = []
    for folder in {p.parent for p in _modules().values()}:
        names = [p.stem for p in folder.iterdir() if (p.suffix == ".py" or (p / "__init__.py").exists())
                 and p.stem != "__init__" and not p.stem.startswith("_")]
        heads = collections.Counter(n.split("_")[0] for n in names if "_" in n)
        for name in names:
            head = name.split("_")[0]
            if "_" in name and (heads[head] > 1 or head in names):
                families.append(f"{folder.relative_to(ROOT)}/{name}")
    assert not families, f"prefix families (make a folder): {sorted(families)}"


def test_every_package_is_listed_for_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert found == listed, f"pyproject.toml [tool.setuptools] packages: missing {sorted(found - listed)}, stale {sorted(listed - found)}"


def test_the_old_import_paths_still_work():
    from memwrap.hookspecs import memwrap_optimizers
    from memwrap.plugins import hookimpl
    from memwrap.registry import OptimizerSpec, predict_state_bytes

    assert hookimpl is memwrap.hookimpl and OptimizerSpec is memwrap.OptimizerSpec
    assert callable(predict_state_bytes) and callable(memwrap_optimizers)
    for shim in SHIMS:
        assert not _import_graph()[shim] - {"memwrap.plugin.registry", "memwrap.plugin.state_size",
                                            "memwrap.plugin.manager", "memwrap.plugin.hookspecs"}, shim


def test_import_memwrap_imports_no_optional_dependency():
    code = ("import sys, memwrap, memwrap.wrapper, memwrap.memory, memwrap.integrations.lightning, "
            "memwrap.integrations.transformers\n"
            "bad = [m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning', 'bitsandbytes', 'torchao',"
            " 'optimi', 'galore_torch', 'apollo_torch', 'lomo_optim', 'schedulefree', 'grokadamw', 'matplotlib', 'rich')"
            " if m in sys.modules]\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# Why an import of memwrap's own modules may stay inside a function (issue 19 item 3): its cost, an optional
# dependency behind it, the lazily loaded public API, or a name bound on one branch only. Each says which. (Holding
# the number of import floors is not a reason: docs/architecture.md says how the planner stays on eight.)
_LAZY_REASONS = ("import cost", "optional dependency", "public API", "on this branch only")


def test_every_import_inside_a_function_says_why():
    unexplained = []
    for name, path in sorted(_modules().items()):
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for s in t.body for n in ast.walk(s)}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("memwrap"):
                    continue
                if id(node) in guarded:  # try: ... except ImportError: the except says what is missing
                    continue
                said = " ".join(lines[max(0, node.lineno - 3):node.end_lineno]).lower()
                if not any(reason.lower() in said for reason in _LAZY_REASONS):
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import ...")
    assert not unexplained, ("imports inside functions with no reason (move them to the top of the module, or say "
                             f"which of {_LAZY_REASONS} keeps them there):\n" + "\n".join(unexplained))


def test_a_wrap_without_budget_does_not_load_the_planner():
    # Import cost is the reason the planner stays lazy in wrap()'s path; this keeps it true.
    code = ("import sys, torch, memwrap\n"
            "net = torch.nn.Linear(2, 2)\n"
            "model, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), precision='bf16', accumulate=2)\n"
            "model(torch.randn(3, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
            "print(sorted(m for m in sys.modules if m.startswith('memwrap.memory')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
