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
from memwrap.plugin import manager as plugins
from memwrap.plugin.manager import (ENV_BLOCK, ENV_DISABLE_AUTOLOAD, PluginLoadWarning, get_plugin_manager, plugin_errors,
                             plugin_info, reset_plugin_manager)
from memwrap.plugin.registry import (OptimizerConflictError, UnknownOptimizerError, create_optimizer, get_optimizer_spec,
                              optimizers)

EXAMPLE = Path(__file__).parent / "example_plugin"
BUILTIN_OPTIMIZERS = {"adamw", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "adafactor"}
BUILTIN_PLUGINS = ("torch_optim", "bitsandbytes", "adafactor")  # at least these (precision plugins join them)

GOOD_PLUGIN = '''
import torch, memwrap
from memwrap.plugin.registry import OptimizerSpec

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
    assert set(BUILTIN_PLUGINS) <= set(builtins)
    assert all(i.status == "loaded" and i.distribution.startswith("memwrap") for i in builtins.values())
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
    assert set(BUILTIN_PLUGINS) <= set(infos)
    assert {(i.status, i.distribution) for i in infos.values()} == {("loaded", "memwrap (source tree)")}
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
    code = ("import sys, memwrap; rows = memwrap.optimizers(); import memwrap.plugin.registry as r; "
            "r.get_optimizer_spec('adamw_8bit'); assert 'bitsandbytes' not in sys.modules, 'imported'; "
            "print(len(rows))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= len(BUILTIN_OPTIMIZERS)


def test_hookspecs_document_their_contract():
    from memwrap.plugin import hookspecs

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


# -- a plugin's failure stays in the plugin (issue 11, item 3) -------------------------------------------------

POLICY_PLUGIN = '''
import memwrap

@memwrap.hookimpl
def memwrap_checkpoint_policies():
    return {policies}
'''

SPEC_PLUGIN = '''
import torch, memwrap
from memwrap.plugin.registry import OptimizerSpec

def boom(*args, **kwargs):
    raise RuntimeError("{message}")

@memwrap.hookimpl
def memwrap_optimizers():
    return [OptimizerSpec(name={name!r}, factory={factory}, state_bytes={state_bytes}, available={available},
                          runs_on_fake={runs_on_fake}, defaults={{"lr": 0.1}})]
'''


def spec_plugin(name, *, factory="torch.optim.SGD", state_bytes="lambda p, module=None, **hp: 0",
                available="lambda: (True, '')", runs_on_fake=True, message="plugin bug"):
    return SPEC_PLUGIN.format(name=name, factory=factory, state_bytes=state_bytes, available=available,
                              runs_on_fake=runs_on_fake, message=message)


def errors_of(plugin):
    return [e for e in plugin_errors() if e.name == plugin]


class MLPBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())

    def forward(self, x):
        return x + self.mlp(x)


def test_checkpoint_policy_hook_that_raises_does_not_break_other_plugins_policies(site):
    from memwrap.checkpointing.policies import parse_checkpoint_option

    site("polbroken-dist", {"polbroken": "memwrap_polbroken_mod"}, {"memwrap_polbroken_mod": """
        import memwrap
        @memwrap.hookimpl
        def memwrap_checkpoint_policies():
            raise RuntimeError("policy table exploded")
    """})
    site("polgood-dist", {"polgood": "memwrap_polgood_mod"},
         {"memwrap_polgood_mod": POLICY_PLUGIN.format(policies='{"mlp-only": lambda name, m: name.endswith(".mlp")}')})
    with pytest.warns(PluginLoadWarning, match=r"'polbroken'.*'polbroken-dist'.*memwrap_checkpoint_policies.*"
                                               r"policy table exploded") as record:
        assert parse_checkpoint_option("mlp-only") == {"policy": "mlp-only"}
    assert sum("polbroken" in str(w.message) for w in record) == 1
    # the did-you-mean hint and a second lookup work too, and the failure is reported once
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        with pytest.raises(ValueError, match="Did you mean 'mlp-only'"):
            parse_checkpoint_option("mlp-onyl")
        model = torch.nn.Sequential(MLPBlock(), MLPBlock())
        wmodel = memwrap.wrap(model, checkpoint="mlp-only")
        x = torch.randn(3, 4, requires_grad=True)
        wmodel(x).sum().backward()
        assert x.grad is not None
        memwrap.unwrap(wmodel)
    [err] = errors_of("polbroken")
    assert (err.distribution, err.hook, type(err.exception)) == ("polbroken-dist", "memwrap_checkpoint_policies",
                                                                 RuntimeError)
    assert not errors_of("polgood")


def test_checkpoint_policy_hook_returning_garbage_or_clashing_is_isolated(site):
    from memwrap.checkpointing.policies import parse_checkpoint_option

    site("polbad-dist", {"polbad": "memwrap_polbad_mod"}, {"memwrap_polbad_mod": POLICY_PLUGIN.format(
        policies='["mlp-only"]')})
    site("pola-dist", {"pola": "memwrap_pola_mod"}, {"memwrap_pola_mod": POLICY_PLUGIN.format(
        policies='{"shared": lambda n, m: False, "a-only": lambda n, m: False}')})
    site("polb-dist", {"polb": "memwrap_polb_mod"}, {"memwrap_polb_mod": POLICY_PLUGIN.format(
        policies='{"shared": lambda n, m: False, "b-only": lambda n, m: False}')})
    with pytest.warns(PluginLoadWarning, match=r"'polbad'.*must return a dict"):
        assert parse_checkpoint_option("a-only") == {"policy": "a-only"}
    assert parse_checkpoint_option("b-only") == {"policy": "b-only"}
    with pytest.raises(ValueError, match=r"'shared' is defined by two plugins.*'pola'.*'pola-dist'.*'polb'.*'polb-dist'"):
        parse_checkpoint_option("shared")
    with pytest.raises(ValueError, match="Did you mean 'a-only'"):
        parse_checkpoint_option("a-onyl")
    assert [e.hook for e in errors_of("polbad")] == ["memwrap_checkpoint_policies"]


def test_spec_whose_state_bytes_or_available_raises_is_listed_unavailable_with_the_reason(site):
    site("bytes-dist", {"bytesbug": "memwrap_bytes_mod"},
         {"memwrap_bytes_mod": spec_plugin("bad_bytes", state_bytes="boom", message="state probe exploded")})
    site("avail-dist", {"availbug": "memwrap_avail_mod"},
         {"memwrap_avail_mod": spec_plugin("bad_avail", available="boom", message="availability probe exploded")})
    with pytest.warns(PluginLoadWarning) as record:
        rows = {r.name: r for r in memwrap.optimizers()}
    assert rows["adamw"].available and rows["adamw"].state_bytes_per_param == pytest.approx(8.0, rel=1e-5)
    assert not rows["bad_bytes"].available and "state probe exploded" in rows["bad_bytes"].install_hint
    assert "'bytesbug'" in rows["bad_bytes"].install_hint and "'bytes-dist'" in rows["bad_bytes"].install_hint
    assert not rows["bad_avail"].available and "availability probe exploded" in rows["bad_avail"].install_hint
    assert len(record) == 2
    [b] = errors_of("bytesbug")
    [a] = errors_of("availbug")
    assert (b.distribution, b.hook, str(b.exception)) == ("bytes-dist", "bad_bytes.state_bytes", "state probe exploded")
    assert (a.distribution, a.hook, str(a.exception)) == ("avail-dist", "bad_avail.available",
                                                          "availability probe exploded")
    with warnings.catch_warnings():  # reported once: listing again is quiet
        warnings.simplefilter("error", PluginLoadWarning)
        memwrap.optimizers()
        with pytest.raises(memwrap.plugin.registry.OptimizerUnavailableError, match="availability probe exploded"):
            create_optimizer("bad_avail", [torch.zeros(1, requires_grad=True)])
        with pytest.raises(plugins.PluginError, match=r"'bytesbug'.*'bytes-dist'.*bad_bytes.state_bytes"):
            memwrap.plugin.state_size.predict_state_bytes("bad_bytes", torch.nn.Linear(2, 2))
    assert type(create_optimizer("adamw", [torch.zeros(1, requires_grad=True)])) is torch.optim.AdamW


def test_factory_returning_none_is_refused_at_once_naming_the_plugin(site):
    site("nonefac-dist", {"nonefac": "memwrap_nonefac_mod"},
         {"memwrap_nonefac_mod": spec_plugin("none_opt", factory="lambda params, **hp: None")})
    model = torch.nn.Linear(2, 2)
    with pytest.warns(PluginLoadWarning), pytest.raises(
            plugins.PluginError, match=r"'nonefac'.*'nonefac-dist'.*none_opt.factory returned None.*torch.optim.Optimizer"):
        create_optimizer("none_opt", model.parameters())
    [err] = errors_of("nonefac")
    assert err.hook == "none_opt.factory" and err.distribution == "nonefac-dist"
    # wrap(optim=...) refuses it too, before touching anything
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(plugins.PluginError, match="none_opt.factory returned None"):
        memwrap.wrap(model, opt, optim="none_opt")
    assert not hasattr(model, "_memwrap") and type(opt) is torch.optim.AdamW


def test_a_bad_hyperparameter_is_the_callers_error_not_a_plugin_failure():
    with pytest.raises(ValueError, match=r"optimizer 'adamw': lr=-1.0 must be a finite number >= 0. Fix"):
        create_optimizer("adamw", [torch.zeros(1, requires_grad=True)], lr=-1.0)  # memwrap's own check
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):  # the backend's, passed on
        create_optimizer("sgd", [torch.zeros(1, requires_grad=True)], lr=0.1, nesterov=True)
    assert not plugin_errors()


def test_misspelled_hook_makes_the_plugin_fail_visibly(site):
    site("typo2-dist", {"typo2": "memwrap_typo2_mod"}, {"memwrap_typo2_mod": GOOD_PLUGIN.format(
        name="typo_sgd", aliases=()) + """
@memwrap.hookimpl
def memwrap_checkpoint_policy():
    return {}
"""})
    with pytest.warns(PluginLoadWarning, match="Did you mean 'memwrap_checkpoint_policies'"):
        errors = plugin_errors()
    [err] = [e for e in errors if e.name == "typo2"]
    assert (err.status, err.distribution, err.hook) == ("failed", "typo2-dist", "memwrap_checkpoint_policy")
    assert info_named("typo2").status == "failed"
    # a failed plugin contributes nothing (half a plugin would behave differently from what its author tested)
    with pytest.raises(UnknownOptimizerError, match=r"typo2.*failed"):
        get_optimizer_spec("typo_sgd")
    assert get_optimizer_spec("adamw").name == "adamw"


def test_registering_by_hand_a_plugin_with_a_misspelled_hook_is_refused():
    import pluggy

    class Typo:
        @memwrap.hookimpl
        def memwrap_optimizer(self):
            return []

    pm = get_plugin_manager()
    with pytest.raises(pluggy.PluginValidationError, match="Did you mean 'memwrap_optimizers'"):
        pm.register(Typo(), name="typo_by_hand")
    assert not pm.has_plugin("typo_by_hand")


def test_plan_and_cli_skip_a_broken_optimizer_with_a_note(site, capsys):
    from memwrap.memory.cli import register
    import argparse

    site("planbug-dist", {"planbug": "memwrap_planbug_mod"}, {"memwrap_planbug_mod": """
        import torch, memwrap
        from memwrap.plugin.registry import OptimizerSpec

        def no_bytes(param, module=None, **hp):
            raise RuntimeError("no bytes today")

        @memwrap.hookimpl
        def memwrap_optimizers():
            return [OptimizerSpec(name="bytes_bug", factory=torch.optim.SGD, state_bytes=no_bytes, runs_on_fake=False,
                                  defaults={"lr": 0.1}),
                    OptimizerSpec(name="none_fac", factory=lambda params, **hp: None,
                                  state_bytes=lambda p, module=None, **hp: 0)]
    """})
    model = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))  # noqa: E731
    grid = dict(budget="8GiB", global_batch=2, micro_batches=[2], precisions=["fp32"], checkpoints=[None])
    with pytest.warns(PluginLoadWarning):
        assert memwrap.plan(model, lambda mb: torch.randn(mb, 8), keep_optim=None, **grid).best is not None  # all defaults
    p = memwrap.plan(model, lambda mb: torch.randn(mb, 8), optimizers=["adamw", "bytes_bug", "none_fac"], **grid)
    assert {c.optim for c in p.candidates} == {"adamw"}  # step_in_backward on/off: adamw twice
    notes = {label.split()[-1]: why for label, why in p.skipped}
    assert set(notes) == {"bytes_bug", "none_fac"}
    assert "no bytes today" in notes["bytes_bug"] and "'planbug-dist'" in notes["bytes_bug"]
    assert "returned None" in notes["none_fac"] and "'planbug-dist'" in notes["none_fac"]
    parser = argparse.ArgumentParser(prog="memwrap")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--preset", "llama-tiny", "--batch", "2", "--seq", "16", "--budget", "4GiB",
                              "--micro-batches", "2", "--precisions", "fp32", "--checkpoints", "none", "--quiet",
                              "--optimizers", "adamw,bytes_bug"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "bytes_bug" in out and "planbug" in out


def test_conformance_kit_reports_a_broken_spec_as_a_failed_check(site):
    from memwrap.testing import check_optimizer

    site("kit-dist", {"kitbug": "memwrap_kit_mod"}, {"memwrap_kit_mod": """
        import torch, memwrap
        from memwrap.plugin.registry import OptimizerSpec

        def no_bytes(param, module=None, **hp):
            raise RuntimeError("no bytes today")

        @memwrap.hookimpl
        def memwrap_optimizers():
            return [OptimizerSpec(name="kit_bytes", factory=torch.optim.SGD, state_bytes=no_bytes, defaults={"lr": 0.1}),
                    OptimizerSpec(name="kit_none", factory=lambda params, **hp: None,
                                  state_bytes=lambda p, module=None, **hp: 0)]
    """})
    with pytest.warns(PluginLoadWarning), pytest.raises(
            AssertionError, match=r"check_optimizer\('kit_bytes'\) failed \[state_bytes\].*'kitbug'.*no bytes today"):
        check_optimizer("kit_bytes", checks=("spec", "state_bytes"))
    with pytest.warns(PluginLoadWarning), pytest.raises(
            AssertionError, match=r"check_optimizer\('kit_none'\) failed \[loss\].*'kitbug'.*returned None"):
        check_optimizer("kit_none", checks=("loss",))
    # a failure the plugin had before the kit ran (here: at listing) fails the kit too
    with pytest.raises(AssertionError, match=r"\[plugin\].*kit_bytes.state_bytes"):
        check_optimizer("kit_bytes", checks=("spec",))


def test_guarding_covers_hooks_and_spec_fields_added_later(site):
    """New hooks (a precision hook, say) and new callable OptimizerSpec fields are guarded without edits."""
    import dataclasses
    from collections.abc import Callable

    import pluggy

    from memwrap.plugin.calls import call_hook
    from memwrap.plugin.registry import OptimizerSpec

    class LaterSpecs:
        @pluggy.HookspecMarker("memwrap")
        def memwrap_later_hook(self, size):
            """A hook declared after this test was written."""

    @dataclasses.dataclass(frozen=True)
    class RicherSpec(OptimizerSpec):
        supports: Callable[..., bool] | None = None  # a capability field a later plugin adds

    def bad_supports(model):
        raise KeyError("capability probe")

    class Good:
        @memwrap.hookimpl
        def memwrap_later_hook(self, size):
            return size * 2

        @memwrap.hookimpl
        def memwrap_optimizers(self):
            return [RicherSpec(name="rich", factory=torch.optim.SGD, state_bytes=lambda p, module=None, **hp: 0,
                               defaults={"lr": 0.1}, supports=bad_supports)]

    class Bad:
        @memwrap.hookimpl
        def memwrap_later_hook(self, size):
            raise ValueError("later hook bug")

    pm = get_plugin_manager()
    pm.add_hookspecs(LaterSpecs)
    pm.register(Good(), name="good_later")
    pm.register(Bad(), name="bad_later")
    with pytest.warns(PluginLoadWarning, match=r"'bad_later'.*memwrap_later_hook.*later hook bug"):
        results = call_hook("memwrap_later_hook", size=3)
    assert [(r.plugin, r.result) for r in results] == [("good_later", 6)]
    with pytest.raises(TypeError, match=r"needs the hook's arguments \['size'\]"):
        call_hook("memwrap_later_hook")  # memwrap's own mistake is not blamed on the plugins
    spec = get_optimizer_spec("rich")
    assert isinstance(spec, RicherSpec)
    with pytest.warns(PluginLoadWarning), pytest.raises(plugins.PluginError, match=r"'good_later'.*rich.supports.*KeyError"):
        spec.supports(torch.nn.Linear(2, 2))
    assert {(e.name, e.hook) for e in plugin_errors()} == {("bad_later", "memwrap_later_hook"),
                                                          ("good_later", "rich.supports")}


def test_memwrap_calls_hooks_only_through_the_guarded_path():
    """``pm.hook.memwrap_x()`` lets one plugin's exception escape to every caller; call_hook isolates it."""
    import re

    root = Path(memwrap.__file__).parent
    offenders = []
    for path in [*root.rglob("*.py"), *(root.parent / "plugins").rglob("*.py")]:
        if path.relative_to(root.parent).as_posix() in ("memwrap/plugin/calls.py", "memwrap/plugin/manager.py"):  # the guarded path, the manager
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.hook\.memwrap_\w+\s*\(|\.get_hookimpls\(\)", line):
                offenders.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    assert not offenders, "call hooks through memwrap.plugin.calls.call_hook:\n" + "\n".join(offenders)
