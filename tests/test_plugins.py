"""The plugin manager: entry-point discovery, built-ins, failures, conflicts, env vars, fallback."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import memwrap
from memwrap import plugins
from memwrap.plugins import (ENV_BLOCK, ENV_DISABLE_AUTOLOAD, PluginLoadWarning, get_plugin_manager, plugin_errors,
                             plugin_info, reset_plugin_manager)
from memwrap.registry import (OptimizerConflictError, UnknownOptimizerError, create_optimizer, get_optimizer_spec,
                              optimizers)

EXAMPLE = Path(__file__).parent / "example_plugin"
BUILTIN_OPTIMIZERS = {"adamw", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "adafactor"}

GOOD_PLUGIN = '''
import torch, memwrap
from memwrap.registry import OptimizerSpec

@memwrap.hookimpl
def memwrap_optimizers():
    return [OptimizerSpec(name={name!r}, aliases={aliases!r}, factory=torch.optim.SGD,
                          state_bytes=lambda p, module=None, **hp: 0, defaults={{"lr": 0.1}})]
'''


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD, raising=False)
    monkeypatch.delenv(ENV_BLOCK, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def make_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """Write modules plus a ``.dist-info`` folder, as ``pip install`` would, then put ``root`` on sys.path."""
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-2.5.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 2.5\n")
    (info / "entry_points.txt").write_text("[memwrap]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    return root


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    added = set()

    def add(dist, entry_points, modules):
        added.update(modules)
        make_dist(tmp_path, dist, entry_points, modules)
        reset_plugin_manager()

    yield add
    for module in added:
        sys.modules.pop(module, None)


def info_named(name):
    return next(i for i in plugin_info() if i.name == name)


def test_builtins_load_through_the_entry_point_group():
    pm = get_plugin_manager()
    builtins = {i.name: i for i in plugin_info() if i.builtin}
    assert set(builtins) == {"torch_optim", "bitsandbytes", "adafactor"}
    assert all(i.status == "loaded" and i.distribution == "memwrap" for i in builtins.values())
    names = {spec.name for specs in pm.hook.memwrap_optimizers() for spec in specs}
    assert BUILTIN_OPTIMIZERS <= names
    assert memwrap.hookimpl is plugins.hookimpl
    assert get_plugin_manager() is pm
    reset_plugin_manager()
    assert get_plugin_manager() is not pm


def test_example_third_party_plugin_is_discovered_end_to_end(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    reset_plugin_manager()
    info = info_named("sgd_example")
    assert (info.status, info.builtin, info.distribution, info.version) == ("loaded", False, "memwrap-sgd-example", "1.0.0")
    model = torch.nn.Linear(3, 2)
    opt = create_optimizer("sgd_example", model.parameters())
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.9 and opt.defaults["lr"] == 0.05
    assert get_optimizer_spec("SGD-Momentum") is get_optimizer_spec("sgd_example")
    from memwrap.testing import check_optimizer

    check_optimizer("sgd_momentum", checks=("spec", "state_bytes", "fake", "state_dict"))
    sys.modules.pop("memwrap_sgd_example", None)


def test_autoload_env_var_skips_third_party_but_keeps_builtins(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    reset_plugin_manager()
    assert info_named("sgd_example").status == "skipped"
    with pytest.raises(UnknownOptimizerError):
        get_optimizer_spec("sgd_momentum")
    assert get_optimizer_spec("adamw").name == "adamw"
    # Explicit registration still works, and the registry notices the new plugin.
    import memwrap_sgd_example

    get_plugin_manager().register(memwrap_sgd_example, name="sgd_example")
    assert get_optimizer_spec("sgd_momentum").defaults["momentum"] == 0.9
    sys.modules.pop("memwrap_sgd_example", None)


def test_broken_plugin_is_named_with_its_distribution_and_others_still_work(site):
    site("broken-dist", {"broken": "memwrap_broken_mod"},
         {"memwrap_broken_mod": "import a_backend_that_is_not_installed\n"})
    site("good-dist", {"good": "memwrap_good_mod"}, {"memwrap_good_mod": GOOD_PLUGIN.format(name="good_sgd", aliases=())})
    with pytest.warns(PluginLoadWarning) as record:
        get_plugin_manager()
    messages = [str(w.message) for w in record]
    assert len(messages) == 1
    assert "'broken'" in messages[0] and "'broken-dist'" in messages[0] and "a_backend_that_is_not_installed" in messages[0]
    assert [e.name for e in plugin_errors()] == ["broken"]
    assert get_optimizer_spec("good_sgd").name == "good_sgd"
    assert get_optimizer_spec("adamw").name == "adamw"


def test_plugin_whose_hook_raises_is_named_and_isolated(site):
    site("raising-dist", {"raising": "memwrap_raising_mod"}, {"memwrap_raising_mod": """
        import memwrap
        @memwrap.hookimpl
        def memwrap_optimizers():
            raise RuntimeError("backend probe exploded")
    """})
    with pytest.warns(PluginLoadWarning, match=r"'raising'.*'raising-dist'.*backend probe exploded"):
        names = {r.name for r in optimizers()}
    assert BUILTIN_OPTIMIZERS <= names


def test_plugin_failing_validation_is_named_and_isolated(site):
    site("badsig-dist", {"badsig": "memwrap_badsig_mod"}, {"memwrap_badsig_mod": """
        import memwrap
        @memwrap.hookimpl
        def memwrap_optimizers(config):
            return []
    """})
    with pytest.warns(PluginLoadWarning, match=r"'badsig'.*'badsig-dist'.*failed to register"):
        get_plugin_manager()
    assert get_optimizer_spec("adamw_torch").name == "adamw"


def test_misspelled_hook_gets_a_hint(site):
    site("typo-dist", {"typo": "memwrap_typo_mod"}, {"memwrap_typo_mod": """
        import memwrap
        @memwrap.hookimpl
        def memwrap_optimizer():
            return []
    """})
    with pytest.warns(PluginLoadWarning, match="Did you mean 'memwrap_optimizers'"):
        get_plugin_manager()


def test_two_plugins_claiming_one_name_raise_naming_both(site):
    site("first-dist", {"first": "memwrap_first_mod"},
         {"memwrap_first_mod": GOOD_PLUGIN.format(name="dup_opt", aliases=("first_only",))})
    site("second-dist", {"second": "memwrap_second_mod"},
         {"memwrap_second_mod": GOOD_PLUGIN.format(name="second_opt", aliases=("dup_opt",))})
    for name in ("dup_opt", "DUP-OPT"):
        with pytest.raises(OptimizerConflictError) as err:
            get_optimizer_spec(name)
        assert "'first'" in str(err.value) and "'first-dist'" in str(err.value)
        assert "'second'" in str(err.value) and "'second-dist'" in str(err.value)
        assert ENV_BLOCK in str(err.value)
    # Names nobody disputes keep working.
    assert get_optimizer_spec("first_only").name == "dup_opt"
    assert get_optimizer_spec("second_opt").name == "second_opt"
    rows = {r.name: r for r in optimizers()}
    assert not rows["dup_opt"].available and "conflict" in rows["dup_opt"].install_hint
    assert not rows["second_opt"].available and rows["adamw"].available


def test_third_party_claiming_a_builtin_alias_conflicts(site, monkeypatch):
    site("shadow-dist", {"shadow": "memwrap_shadow_mod"},
         {"memwrap_shadow_mod": GOOD_PLUGIN.format(name="my_adamw", aliases=("adamw_torch",))})
    with pytest.raises(OptimizerConflictError, match=r"'torch_optim'.*'shadow-dist'"):
        create_optimizer("adamw_torch", [torch.zeros(1, requires_grad=True)])
    # The documented way out: block one of the plugins.
    monkeypatch.setenv(ENV_BLOCK, "shadow")
    reset_plugin_manager()
    assert info_named("shadow").status == "blocked"
    assert get_optimizer_spec("adamw_torch").name == "adamw"


def test_entry_point_name_taken_by_a_builtin_is_refused(site):
    site("impostor-dist", {"torch_optim": "memwrap_impostor_mod"},
         {"memwrap_impostor_mod": GOOD_PLUGIN.format(name="impostor", aliases=())})
    with pytest.warns(PluginLoadWarning, match=r"'impostor-dist'.*already taken by plugin 'torch_optim'"):
        get_plugin_manager()
    assert get_optimizer_spec("adamw").name == "adamw"
    with pytest.raises(UnknownOptimizerError):
        get_optimizer_spec("impostor")


BUILTIN_PLUGINS = ("torch_optim", "bitsandbytes", "adafactor")


def _load_with_builtins_unimportable(monkeypatch, entry_points: list) -> dict:
    """Plugin infos when memwrap_plugins cannot be imported as an installed package (as in a bare checkout)."""
    monkeypatch.setattr(plugins, "_entry_points", lambda: entry_points)
    for name in [m for m in sys.modules if m == "memwrap_plugins" or m.startswith("memwrap_plugins.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "memwrap_plugins", None)
    reset_plugin_manager()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        infos = {i.name: i for i in plugin_info()}
    # the built-ins now come from the plugins/ folder next to memwrap/, and work
    assert sys.modules["memwrap_plugins"].__file__ == str(Path(memwrap.__file__).parent.parent / "plugins" / "__init__.py")
    assert type(create_optimizer("adamw", [torch.zeros(2, requires_grad=True)])) is torch.optim.AdamW
    return infos


def test_source_tree_fallback_registers_builtins_without_metadata(monkeypatch):
    infos = _load_with_builtins_unimportable(monkeypatch, [])
    assert {n: (i.status, i.distribution) for n, i in infos.items()} == {
        n: ("loaded", "memwrap (source tree)") for n in BUILTIN_PLUGINS}
    reset_plugin_manager()


def test_builtins_listed_by_metadata_but_not_importable_load_from_the_source_tree(monkeypatch):
    # A checkout on sys.path beside a memwrap.egg-info (left by an editable install) lists the built-in
    # entry points, yet memwrap_plugins is not importable: the built-ins must still load, from plugins/.
    listed = plugins._entry_points()
    assert any(plugins._is_builtin(ep.value) for ep in listed)
    infos = _load_with_builtins_unimportable(monkeypatch, listed)
    assert {n: infos[n].status for n in BUILTIN_PLUGINS} == dict.fromkeys(BUILTIN_PLUGINS, "loaded")
    reset_plugin_manager()


def test_import_memwrap_and_listing_do_not_import_bitsandbytes():
    code = ("import sys, memwrap; rows = memwrap.optimizers(); import memwrap.registry as r; "
            "r.get_optimizer_spec('adamw_8bit'); assert 'bitsandbytes' not in sys.modules, 'imported'; "
            "print(len(rows))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= len(BUILTIN_OPTIMIZERS)


def test_hookspecs_document_their_contract():
    from memwrap import hookspecs

    pm = get_plugin_manager()
    for name in ("memwrap_optimizers", "memwrap_checkpoint_policies"):
        assert getattr(pm.hook, name).spec is not None
        doc = getattr(hookspecs, name).__doc__
        assert ":return:" in doc and "Called" in doc and "collected" in doc


def test_plugin_using_the_registry_at_import_time_is_refused_not_recursed(site):
    site("eager-dist", {"eager": "memwrap_eager_mod"}, {"memwrap_eager_mod": """
        import memwrap
        memwrap.optimizers()
    """})
    with pytest.warns(PluginLoadWarning, match=r"'eager'.*'eager-dist'.*while plugins are loading"):
        assert get_optimizer_spec("adamw").name == "adamw"
