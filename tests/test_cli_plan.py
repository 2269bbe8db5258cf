"""`memwrap plan`: table, code lines, --json schema, --plot, factory targets, budget parsing errors."""
import argparse
import dataclasses
import json
import re
import textwrap
from pathlib import Path

import pytest

from memwrap.memory import parse_budget
from memwrap.memory.cli import register

pytestmark = pytest.mark.filterwarnings("ignore")

FAST = ["--precisions", "fp32", "--checkpoints", "none,full", "--optimizers", "adamw,adamw_8bit", "--quiet",
        "--step-in-backward", "no", "--chunked-loss", "no"]  # those dimensions: tests/test_ladder.py


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="memwrap")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_preset_table_and_code_lines(capsys):
    rc = run_cli(["--preset", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "4GiB", *FAST])
    out = capsys.readouterr().out
    assert rc == 0
    header = next(line for line in out.splitlines() if line.startswith(" #") or line.startswith("#"))
    for col in ("candidate", "params", "grads", "opt state", "activations", "peak MiB", "+margin", "fits", "cost"):
        assert col in header  # a tiny model: MiB, so that its figures do not all read 0.00
    lines = out.splitlines()
    assert "import memwrap" in lines
    code = lines[lines.index("import memwrap") + 1]
    assert code.startswith("model, optimizer = memwrap.wrap(model, optimizer, precision='fp32', accumulate=")
    assert "best:" in out
    rows = [line for line in lines if re.match(r"^\s*\d+\s+\d+x\d+ ", line)]
    assert len(rows) == 8 and all(" yes " in r for r in rows)  # 4 GiB holds this tiny model in every config


def test_json_schema(capsys):
    rc = run_cli(["--preset", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "4GiB", "--json", *FAST])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {"budget", "global_batch", "margin", "fits", "verdict", "best", "code", "candidates", "seconds"} <= set(data)
    assert data["budget"] == 4 * 2**30 and data["global_batch"] == 2
    assert len(data["candidates"]) == 2 * 2 * 2  # micro-batches {2, 1} x checkpoints x optimizers
    c = data["candidates"][0]
    assert {"label", "micro_batch", "accumulate", "options", "peak", "margin", "required", "fits", "cost",
            "cost_terms", "estimate"} <= set(c)
    assert set(c["estimate"]["breakdown"]) == {"parameters", "buffers", "gradients", "optimizer_state",
                                               "activations", "temporaries", "other"}
    assert c["required"] == c["peak"] + c["margin"]
    assert data["best"]["options"]["accumulate"] * data["best"]["micro_batch"] == 2


def test_factory_target_from_a_file_with_plot_and_no_fit(tmp_path, capsys):
    src = tmp_path / "mymodel.py"
    src.write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    """))
    png, js = tmp_path / "plan.png", tmp_path / "plan.json"
    rc = run_cli([f"{src}:build", "--input-shape", "8,16", "--budget", "1000B", "--margin-bytes", "0", "--micro-batches", "8",
                  "--plot", str(png), "--json", str(js), *FAST])
    out = capsys.readouterr().out
    assert rc == 3 and "nothing fits" in out  # 3: nothing fits, as `memwrap demo`
    # checkpoint=full is not traced: the no-checkpointing trace's weights, gradients and state already exceed 1000 B
    assert "skipped 2 candidate(s)" in out and "the weights, gradients and optimizer state alone" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    assert data["best"] is None and not data["fits"] and len(data["candidates"]) == 2
    assert {s["label"] for s in data["skipped"]} == {"8x1 fp32 full adamw", "8x1 fp32 full adamw_8bit"}


def test_module_target_and_bad_targets(capsys):
    rc = run_cli(["memwrap.models:GPT", "--input-shape", "2,16", "--input-dtype", "long", "--input-high", "50257",
                  "--budget", "80GiB", "--checkpoints", "none", "--precisions", "bf16", "--optimizers", "adamw",
                  "--micro-batches", "2", "--quiet"])
    assert rc == 0 and "accumulate=1" in capsys.readouterr().out
    bad = [(["memwrap.models", "--input-shape", "2,16"], "package.module:factory"),
           (["memwrap.models:GTP", "--input-shape", "2,16"], "Did you mean 'GPT'"),
           (["memwrap.models:GPT"], "input-shape"),
           (["no_such_module_xyz:build", "--input-shape", "2,16"], "cannot import 'no_such_module_xyz'"),
           (["--preset", "llama-8b"], "Valid presets"),
           (["--preset", "llama-tiny", "--input-shape", "2,16"], "--input-shape apply to a model factory"),
           (["--preset", "llama-tiny", "--input-dtype", "long"], "--input-dtype apply to a model factory"),
           (["--preset", "llama-tiny", "--batch", "0"], "--batch 0 is not valid"),
           (["memwrap.models:GPT", "--input-shape", "2,16", "--batch", "-2"], "--batch -2 is not valid"),
           (["--preset", "llama-tiny", "--top", "0"], "--top 0 is not valid"),
           (["--preset", "llama-tiny", "--top", "many"], "or 'all'"),
           (["--preset", "llama-tiny", "--micro-batches", "a,b"], "--micro-batches"),
           ]
    for argv, message in bad:  # every input error: exit status 2 and the problem on stderr
        assert run_cli([*argv, "--budget", "1GiB", "--quiet"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("memwrap plan: ") and message in err, (argv, err)


def test_module_target_from_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "cwd_model_pkg_test.py").write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".", str(tmp_path))])
    before = list(__import__("sys").path)
    rc = run_cli(["cwd_model_pkg_test:build", "--input-shape", "4,16", "--budget", "2GiB", "--micro-batches", "4",
                  *FAST])
    assert rc == 0 and "best:" in capsys.readouterr().out
    assert __import__("sys").path == before  # the current directory is searched for that import only


def test_margin_flags_are_validated_as_margins(capsys):
    base = ["--preset", "llama-tiny", "--batch", "1", "--seq", "16", "--budget", "4GiB", "--micro-batches", "1",
            "--precisions", "fp32", "--checkpoints", "none", "--optimizers", "adamw", "--quiet"]
    for flags in (["--margin=1.5"], ["--margin=-0.1"], ["--margin-bytes=lots"], ["--margin-bytes=-1GiB"]):
        assert run_cli([*base, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert "margin" in err and "budget" not in err, (flags, err)
    for zero in ("0B", "0GiB", "0"):
        assert run_cli([*base, "--margin", "0", "--margin-bytes", zero, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["margin"] == {"fraction": 0.0, "fixed": 0}
        assert data["best"]["margin"] == 0 and data["best"]["required"] == data["best"]["peak"]


def test_top_limits_the_table_on_a_terminal_too(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    rc = run_cli(["--preset", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "4GiB", "--top", "3", *FAST])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if re.match(r"^\W*\d+\W+\d+x\d+ ", line)]
    assert len(rows) == 3, out
    assert "5 more candidates not shown (3 of 8): --top all shows every one" in out


def test_plot_draws_every_candidate(tmp_path, monkeypatch):
    import matplotlib.axes

    from memwrap.memory import plan
    from memwrap.memory.search.report import plot_plan
    from memwrap.models import build_preset, preset_batch

    p = plan(lambda: build_preset("llama-tiny"), lambda mb: preset_batch("llama-tiny", mb, 16), budget="4GiB",
             global_batch=4, micro_batches=(4, 1), precisions=("fp32",), checkpoints=(None, "full"),
             optimizers=("adamw", "adamw_8bit"), step_in_backward=(False,))
    many = dataclasses.replace(p, candidates=p.candidates * 6)  # 48 bars: more than the old cut of 40
    titles, ticks = [], []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    real = matplotlib.axes.Axes.set_xticklabels
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticklabels",
                        lambda self, labels, *a, **k: (ticks.append(list(labels)), real(self, labels, *a, **k))[1])
    plot_plan(many, str(tmp_path / "all.png"))
    assert len(ticks[-1]) == 48 and "all 48 candidates" in titles[-1]
    plot_plan(many, str(tmp_path / "some.png"), limit=10)
    assert len(ticks[-1]) == 10 and "first 10 of 48 candidates" in titles[-1]


def test_bad_budget_exits_2_with_accepted_forms(capsys):
    assert run_cli(["--preset", "llama-tiny", "--budget", "lots", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "24GiB" in err and "24GB" in err


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * 2**30), ("24 GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("24 GB", 24 * 10**9),
    (25769803776, 25769803776), ("1.5 TiB", int(1.5 * 2**40)), ("512MiB", 512 * 2**20), ("24G", 24 * 2**30),
    ("100B", 100), (" 2gib ", 2 * 2**30), (2**20, 2**20),
])
def test_parse_budget_accepts(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["lots", "24 GiBs", "-1GB", "0", 0, -5, "GB", "1e9", "", None, True, [24], "24", 24,
                                 "1.5", 2**20 - 1])
def test_parse_budget_rejects_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="Accepted|accepted|GiB'") as info:
        parse_budget(bad)
    assert "GiB" in str(info.value)


@pytest.mark.parametrize("bad", ["24", 24, " 80 "])
def test_a_budget_without_its_unit_is_refused_not_read_as_bytes(bad):
    with pytest.raises(ValueError, match="bytes") as info:
        parse_budget(bad)
    n = str(bad).strip()
    assert f"'{n}GiB'" in str(info.value) and f"'{n}B'" in str(info.value)  # the fix, both ways
    assert parse_budget("0", what="margin", allow_zero=True) == 0 == parse_budget(0, what="margin", allow_zero=True)
    assert parse_budget(1000, what="margin", allow_zero=True) == 1000  # margins are sizes in bytes, no floor


def test_cli_budget_without_a_unit_exits_2_naming_the_flag(capsys):
    assert run_cli(["--preset", "llama-tiny", "--budget", "24", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memwrap plan: --budget '24' has no unit") and "'24GiB'" in err


def test_parse_budget_suggests_a_unit():
    with pytest.raises(ValueError, match="Did you mean unit 'gib'"):
        parse_budget("24 gibb")


def test_factory_flags_that_would_be_ignored_are_refused(tmp_path, capsys):
    base = ["memwrap.models:GPT", "--budget", "80GiB", "--quiet"]
    assert run_cli([*base, "--input-shape", "2,16", "--input-dtype", "long", "--seq", "4096"]) == 2
    assert "--seq 4096 applies to --preset models" in capsys.readouterr().err
    assert run_cli([*base, "--input-shape", "2,16", "--input-high", "100"]) == 2
    assert "needs --input-dtype long" in capsys.readouterr().err
    assert run_cli(["--preset", "llama-tiny", "--budget", "1GiB", "--input-high", "100", "--quiet"]) == 2
    assert "--input-high" in capsys.readouterr().err


def test_a_policy_typo_exits_2_instead_of_being_skipped(capsys):
    rc = run_cli(["--preset", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "4GiB", "--precisions", "fp32",
                  "--checkpoints", "none,fulll", "--optimizers", "adamw", "--quiet"])
    assert rc == 2 and "Did you mean 'full'" in capsys.readouterr().err


def test_the_code_lines_stay_whole_on_a_narrow_terminal(monkeypatch, capsys):
    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    rc = run_cli(["--preset", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "4GiB", "--top", "1", *FAST])
    out = capsys.readouterr().out
    assert rc == 0
    code = next(line for line in out.splitlines() if line.startswith("model, optimizer = memwrap.wrap("))
    compile(code.split("  #")[0], "<pasted>", "exec")  # one line, valid Python


# --- exit status, --version, option typos ---------------------------------------------------------

MLP = "import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))\n"


def mlp(tmp_path, *flags):
    """A factory target whose traces take milliseconds, and its flags."""
    src = tmp_path / "mlp_factory.py"
    src.write_text(MLP)
    return [f"{src}:build", "--input-shape", "8,16", "--margin-bytes", "0", "--checkpoints", "none", "--quiet",
            "--step-in-backward", "no", *flags]


@pytest.mark.parametrize("output", [[], ["--json"], ["--json", "PATH"]])
def test_nothing_fits_exits_3_in_every_output_mode(output, tmp_path, capsys):
    output = [str(tmp_path / "p.json") if o == "PATH" else o for o in output]
    argv = mlp(tmp_path, "--micro-batches", "8", "--precisions", "fp32", "--optimizers", "adamw")
    assert run_cli([*argv, "--budget", "1000B", *output]) == 3
    out = capsys.readouterr().out
    data = json.loads(out) if output == ["--json"] else json.loads((tmp_path / "p.json").read_text()) if output else None
    assert "nothing fits" in (out if data is None else data["verdict"])
    assert run_cli([*argv, "--budget", "1GiB", *output]) == 0


def test_main_has_version_and_documents_exit_codes(capsys):
    from memwrap import __version__
    from memwrap.cli import build_parser, main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith(f"memwrap {__version__} (torch ")
    assert "3 nothing fits" in build_parser().format_help()
    plan_help = next(a for a in build_parser()._actions if a.dest == "command").choices["plan"].format_help()
    assert "3 when nothing fits" in " ".join(plan_help.split())


@pytest.mark.parametrize("argv,typo,suggestion", [
    (["plan", "--preset", "llama-tiny", "--budjet", "1GiB"], "--budjet", "--budget"),
    (["plan", "--preset", "llama-tiny", "--budget", "1GiB", "--seq-len", "64"], "--seq-len", "--seq"),
    (["plan", "--preset", "llama-tiny", "--budget", "1GiB", "--optimisers=adamw"], "--optimisers", "--optimizers"),
    (["demo", "--stpes", "3"], "--stpes", "--steps"),
])
def test_an_unknown_option_gets_a_suggestion(argv, typo, suggestion, capsys):
    from memwrap.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"unknown option {typo}. Did you mean '{suggestion}'?" in err, err


def test_default_top_hides_rows_and_says_how_to_show_all(tmp_path, capsys):
    argv = mlp(tmp_path, "--budget", "1GiB", "--precisions", "bf16,fp32", "--optimizers", "adamw,adamw_8bit,adafactor")
    assert run_cli(argv) == 0  # 4 micro-batches x 2 precisions x 3 optimizers = 24 candidates
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^\s*\d+\s+\d+x\d+ ", line)]
    assert len(rows) == 20 and "4 more candidates not shown (20 of 24): --top all shows every one" in out
    assert run_cli([*argv, "--top", "all"]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if re.match(r"^\s*\d+\s+\d+x\d+ ", line)]) == 24
    assert "not shown" not in out


def test_one_memory_unit_for_header_table_and_verdict(capsys):
    assert run_cli(["--preset", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "4GiB", *FAST]) == 0
    out = capsys.readouterr().out
    assert "GiB" not in out  # a tiny model: the budget, margin, columns and verdict all read in MiB
    header = out.splitlines()[0]
    assert "budget 4096.00 MiB" in header and "+ 1024.00 MiB" in header
    verdict = next(line for line in out.splitlines() if line.startswith("best:"))
    assert verdict.count("MiB") >= 4 and "of 4096.00 MiB" in verdict


def test_plot_title_says_how_candidates_are_ranked(tmp_path, monkeypatch):
    import matplotlib.axes

    from memwrap.memory import plan
    from memwrap.memory.search.report import plot_plan
    from memwrap.models import build_preset, preset_batch

    p = plan(lambda: build_preset("llama-tiny"), lambda mb: preset_batch("llama-tiny", mb, 16), budget="4GiB",
             global_batch=2, micro_batches=(2,), precisions=("fp32",), checkpoints=(None,),
             optimizers=("adamw", "adamw_8bit"))
    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    plot_plan(p, str(tmp_path / "fits.png"))
    assert "those keeping adamw first, by predicted step time" in titles[-1]
    plot_plan(p.with_budget("1MiB"), str(tmp_path / "none.png"))
    assert "nothing fits: ranked by memory needed" in titles[-1] and "step time" not in titles[-1]


# --- the CLI traces the step training runs (issue 11, item 11) ---------------------------------------

GPT2_FACTORY = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def build():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=4000, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))
"""


@pytest.mark.slow  # importing transformers takes most of it
def test_a_causal_lm_factory_is_traced_with_its_labels_and_cross_entropy(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    import torch

    from memwrap.memory import measure_peak

    src = tmp_path / "gpt2_factory.py"
    src.write_text(GPT2_FACTORY)
    calls = []
    real_ce = torch.nn.functional.cross_entropy
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", lambda *a, **k: (calls.append(1), real_ce(*a, **k))[1])
    rc = run_cli([f"{src}:build", "--input-shape", "4,32", "--input-dtype", "long", "--budget", "4GiB",
                  "--precisions", "fp32", "--checkpoints", "none", "--optimizers", "adamw", "--margin", "0",
                  "--margin-bytes", "0", "--json"])
    predicted = json.loads(capsys.readouterr().out)["best"]["peak"]
    assert rc == 0 and calls, "the traced step never computed the model's cross-entropy"
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", real_ce)
    namespace = {}
    exec(compile(GPT2_FACTORY, str(src), "exec"), namespace)
    ids = torch.randint(0, 4000, (4, 32), generator=torch.Generator().manual_seed(0))
    measured = measure_peak(namespace["build"], {"input_ids": ids, "labels": ids}, None, steps=1, precision="fp32")
    # The real step (labels -> the model's own shifted cross-entropy): before, a mean square of the logits was
    # traced instead, about 50% above this measurement at this size.
    assert abs(predicted - measured["peak"]) / measured["peak"] < 0.01, (predicted, measured["peak"])


def test_a_factory_can_bring_its_batches_and_loss(tmp_path, capsys):
    import torch

    from memwrap.memory import estimate

    src = tmp_path / "triple.py"
    src.write_text(textwrap.dedent("""
        import torch

        def make_batch(mb):
            return torch.randn(mb, 16), torch.randint(0, 4, (mb,))

        def loss_fn(outputs, targets):
            return torch.nn.functional.cross_entropy(outputs, targets, label_smoothing=0.1)

        def build():
            model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
            return model, make_batch, loss_fn
    """))
    base = [f"{src}:build", "--budget", "1GiB", "--margin-bytes", "0", "--precisions", "fp32", "--checkpoints", "none", "--optimizers",
            "adamw", "--quiet"]
    assert run_cli([*base, "--batch", "8", "--micro-batches", "8", "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["best"]["peak"]
    ns = {}
    exec(compile(src.read_text(), str(src), "exec"), ns)
    direct = estimate(lambda: ns["build"]()[0], lambda: ns["make_batch"](8), loss_fn=ns["loss_fn"], precision="fp32")
    assert predicted == direct.peak
    assert run_cli([*base, "--batch", "8", "--input-shape", "8,16"]) == 2
    assert "--input-shape would be ignored" in capsys.readouterr().err
    assert run_cli(base) == 2
    assert "needs --batch" in capsys.readouterr().err
    src.write_text("def build():\n    return 3\n")
    assert run_cli([*base, "--batch", "8"]) == 2
    assert "returned int; return an nn.Module, or a tuple (model, make_batch)" in capsys.readouterr().err
    assert torch.is_tensor(ns["make_batch"](2)[0])


def test_causal_lm_detection_needs_a_vocabulary_and_a_labels_argument():
    import torch

    from memwrap.memory.cli import causal_lm_vocab
    from memwrap.models import build_preset

    assert causal_lm_vocab(torch.nn.Linear(2, 2)) is None
    assert causal_lm_vocab(build_preset("gpt2-tiny")) is None  # memwrap's own GPT takes no labels
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=321, n_embd=8, n_layer=1, n_head=2))
    assert causal_lm_vocab(lm) == 321


# --- bad input through the real entry point: memwrap's own message, the option, the fix, exit 2, no traceback ----

WIDE32 = """
import torch
def build():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
def build_with_batches():
    return build(), (lambda mb: torch.randn(mb, 31)), None
"""


@pytest.fixture
def wide32(tmp_path, monkeypatch):
    (tmp_path / "wide32_cli_model.py").write_text(WIDE32)
    monkeypatch.chdir(tmp_path)
    return tmp_path


BAD_INPUT = [  # argv, the words the message must hold: the option and the fix
    (["--preset", "gpt2-tiny", "--batch", "4", "--micro-batches", "0"], ["--micro-batches 0", ">= 1", "e.g."]),
    (["--preset", "gpt2-tiny", "--batch", "4", "--micro-batches", "2,-1"], ["--micro-batches", ">= 1"]),
    (["wide32_cli_model:build", "--input-shape", "4,31"], ["--input-shape 4,31", "32", "Fix", "--input-shape 4,32"]),
    (["wide32_cli_model:build_with_batches", "--batch", "4"], ["make_batch", "Fix"]),
    (["no_such_module_xyz:build", "--input-shape", "4,32"], ["no_such_module_xyz", "Fix", ".py:build"]),
    (["wide32_cli_model:no_such_function", "--input-shape", "4,32"], ["no_such_function", "Fix", "build"]),
    (["missing_dir/model.py:build", "--input-shape", "4,32"], ["missing_dir/model.py", "Fix"]),
    (["--preset", "gpt2-tiny", "--batch", "2", "--seq", "100000"], ["--seq 100000", "256", "Fix", "--seq 256"]),
    (["--preset", "gpt2-tiny", "--batch", "2", "--seq", "0"], ["--seq 0", ">= 1"]),
    (["memwrap.models:GPT", "--input-shape", "2,5000", "--input-dtype", "long"],
     ["--input-shape 2,5000", "1024 positions", "Fix", "--input-shape 2,1024"]),
]


@pytest.mark.parametrize("argv,words", BAD_INPUT, ids=["micro-0", "micro-negative", "input-shape", "make-batch",
                                                         "no-module", "no-function", "no-file", "seq-long", "seq-0",
                                                         "factory-positions"])
def test_bad_plan_input_exits_2_with_the_option_and_the_fix(wide32, argv, words, capsys):
    from memwrap.cli import main

    rc = main(["plan", *argv, "--budget", "1GiB", *FAST])
    captured = capsys.readouterr()
    assert rc == 2, captured
    err = captured.err
    assert err.startswith("memwrap plan: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert "fake_tensor" not in err  # torch's own log of the failed fake kernel is not shown


def test_bad_plan_input_from_the_console_script_exits_2_without_a_traceback(wide32):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    done = subprocess.run([sys.executable, "-m", "memwrap.cli", "plan", "wide32_cli_model:build", "--input-shape",
                           "4,31", "--budget", "1GiB", *FAST], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "--input-shape 4,31" in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") <= 2, done.stderr  # the message alone, no log lines around it


# --- what the table shows: every number a decision needs, every abbreviation defined -----------------------------

def _row(out, label):
    return next(line for line in out.splitlines() if re.match(rf"^\s*\d+\s+{re.escape(label)}\s", line))


def test_the_table_shows_paged_state_and_offloaded_activations_and_defines_every_abbreviation(capsys):
    from memwrap.memory.search import report

    rc = run_cli(["--preset", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "4GiB", "--margin-bytes", "0",
                  "--precisions", "bf16-true", "--checkpoints", "offload", "--optimizers", "paged_adamw_8bit",
                  "--micro-batches", "2", "--step-in-backward", "both", "--chunked-loss", "yes", "--keep-optim", "any",
                  "--margin", "0.08", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    columns = re.split(r"\s{2,}", header.strip())
    assert "opt paged/host" in columns and "act offloaded" in columns
    unit = 2**20  # MiB: the tiny model's table unit
    from memwrap.memory.search.planner import plan
    from memwrap.models import get_preset, preset_batch

    again = plan(get_preset("llama-tiny").factory, lambda mb: preset_batch("llama-tiny", mb, 32, labels=True),
                 budget="4GiB", global_batch=2, precisions=["bf16-true"], checkpoints=["offload"],
                 optimizers=["paged_adamw_8bit"], micro_batches=[2], step_in_backward=(False, True),
                 chunked_loss=(True,), keep_optim=None, margin=(0.08, 0))
    for c in again.candidates:  # the figures in the printed table are the estimate's own
        cells = re.split(r"\s{2,}", _row(out, c.label).strip())
        row = dict(zip(columns, cells))
        assert c.estimate.breakdown["optimizer_state"] == 0 and c.estimate.paged_state > 0
        assert row["opt state"] == "0.00"
        assert row["opt paged/host"] == f"{c.estimate.paged_state / unit:.2f}" != "0.00"
        assert row["act offloaded"] == f"{c.estimate.offloaded / unit:.2f}" != "0.00"
    legend = lines[lines.index("legend:"):]
    defined = {line.split()[0] for line in legend[1:] if line.startswith("  ")}
    for c in again.candidates:  # every word of a label that is not an option value as wrap() spells it
        for word in c.label.split()[2:]:
            if word in ("bf16-true", "offload", "paged_adamw_8bit"):
                continue
            assert word in defined, (word, legend)
    for column in ("params", "opt state", "temp+other", "+margin", "opt paged/host", "act offloaded", "cost"):
        assert any(column in line for line in legend), column  # the columns whose name is not self-explaining
    assert report.plan_legend(again) == legend[:len(report.plan_legend(again))]


def test_progress_lines_name_what_each_trace_differs_in_and_its_stage():
    """A staged search (AdamW first, then optimizers with less state): the counter restarts, and the label says
    which stage; within a stage no two traces have the same label."""
    import torch

    from memwrap.memory.search.planner import plan

    calls = []

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, 4))

    # 1.6 MiB: AdamW's 2 MiB of weights, gradients and state do not fit, so the second stage runs.
    plan(mlp, lambda mb: (torch.randn(mb, 256), torch.randn(mb, 4)), budget="1600KiB", global_batch=4,
         precisions=["fp32"], checkpoints=[None], micro_batches=[4], margin=(0, 0), keep_optim="adamw",
         step_in_backward=(False, True), progress=lambda done, total, label: calls.append((done, total, label)),
         loss_fn=torch.nn.functional.mse_loss)
    tracing = [label for _, _, label in calls if "tracing" in label]
    stages = [label.split(":")[0] for label in tracing]
    assert stages[0].startswith("stage 1 (adamw only)") and stages[-1].startswith("stage 2 (nothing keeping adamw fits")
    for stage in set(stages):
        mine = [label for label in tracing if label.startswith(stage)]
        assert len(mine) == len(set(mine)) == 2, mine  # with and without step in backward: two labels
        assert sum("step in backward" in label for label in mine) == 1
    restarts = [i for i, (done, _, _) in enumerate(calls) if done == 0]
    assert len(restarts) == 2 and calls[restarts[1]][2].startswith("stage 2")


def test_plain_progress_prints_one_line_per_trace_with_its_stage(capsys, monkeypatch):
    from memwrap.memory.cli import _Progress

    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    progress = _Progress(quiet=False)
    for done, label in [(0, "stage 1 (adamw only): tracing micro-batch 4, fp32, no checkpointing (adamw)"),
                        (1, "stage 1 (adamw only): traced 1/2"),
                        (1, "stage 1 (adamw only): tracing micro-batch 4, fp32, no checkpointing, step in backward (adamw)"),
                        (2, "stage 1 (adamw only): traced 2/2")]:
        progress(done, 2, label)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "traced 1/2" not in "\n".join(err) and err[-1].endswith("traced 2/2")


# --- noise: what memwrap's own imports and profiler print is held back, the user's own output is not ----------------

NOISE = ("Failed to load", "_pytree", "USDT", "SyncActivityProfilerHandler", "profiler_start", "is an Enum subclass")


def _python(code_or_args, tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


def test_a_plan_of_a_preset_prints_no_library_noise(tmp_path):
    """bf16-true with torchao's 4-bit AdamW: the planner builds it (its compensation is asked of the optimizer), which
    imports torchao in this fresh process; its import-time log lines do not reach the user."""
    done = _python(["-m", "memwrap.cli", "plan", "--preset", "gpt2-tiny", "--batch", "2", "--seq", "32", "--budget",
                    "4GiB", "--precisions", "bf16-true", "--checkpoints", "none", "--optimizers", "adamw,adamw_torch_4bit",
                    "--micro-batches", "2", "--step-in-backward", "no", "--chunked-loss", "no"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "adamw_torch_4bit" in done.stdout
    for noise in NOISE:
        assert noise not in done.stderr and noise not in done.stdout, (noise, done.stderr)
    assert all(line.startswith("[") for line in done.stderr.splitlines()), done.stderr  # progress lines only


def test_memwraps_torchao_import_is_quiet_but_the_users_own_torchao_logs_still_show(tmp_path):
    done = _python(textwrap.dedent("""
        import logging, sys, torch, memwrap
        assert "torchao" not in sys.modules
        memwrap.create_optimizer("adamw_torch_4bit", [torch.nn.Parameter(torch.zeros(4096))], lr=1e-3)
        print("torchao imported:", "torchao.optim" in sys.modules)
        logging.getLogger("torchao").warning("the user's own torchao warning")
        logging.getLogger("torch.utils._pytree").warning("the user's own pytree warning")
    """), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "torchao imported: True" in done.stdout
    for noise in NOISE[:2]:
        assert noise not in done.stderr.replace("the user's own pytree warning", ""), done.stderr
    assert "the user's own torchao warning" in done.stderr and "the user's own pytree warning" in done.stderr


def test_drop_outputs_plans_the_loop_that_drops_them(capsys):
    base = ["--preset", "gpt2-tiny", "--batch", "2", "--seq", "64", "--budget", "4GiB", *FAST]
    argv = [*base, "--json", "-"]
    assert run_cli(argv) == 0
    kept = json.loads(capsys.readouterr().out)
    assert run_cli([*argv, "--drop-outputs"]) == 0
    dropped = json.loads(capsys.readouterr().out)
    # Held outputs only add memory (here the loss saves the logits for backward anyway: 2 MB more at the peak).
    first = {c["label"]: c["peak"] for c in kept["candidates"]}
    assert dropped["candidates"] and all(first[c["label"]] > c["peak"] for c in dropped["candidates"])
    assert {c["estimate"]["keep_outputs"] for c in kept["candidates"]} == {True}
    assert {c["estimate"]["keep_outputs"] for c in dropped["candidates"]} == {False}
    assert "keep_outputs" not in dropped["code"]
    assert run_cli([*base, "--drop-outputs"]) == 0  # the table says which loop was planned
    assert "Loop: planned for a loop that drops the model's outputs" in capsys.readouterr().out
