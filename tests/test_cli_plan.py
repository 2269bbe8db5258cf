"""`memwrap plan`: table, code lines, --json schema, --plot, factory targets, budget parsing errors."""
import argparse
import json
import re
import textwrap

import pytest

from memwrap.memory import parse_budget
from memwrap.memory.cli import register

pytestmark = pytest.mark.filterwarnings("ignore")

FAST = ["--precisions", "fp32", "--checkpoints", "none,full", "--optimizers", "adamw,adamw_8bit", "--quiet"]


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
    for col in ("candidate", "params", "grads", "opt state", "activations", "peak GiB", "+margin", "fits", "cost"):
        assert col in header
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
    rc = run_cli([f"{src}:build", "--input-shape", "8,16", "--budget", "1000", "--margin-bytes", "0", "--micro-batches", "8",
                  "--plot", str(png), "--json", str(js), *FAST])
    out = capsys.readouterr().out
    assert rc == 0 and "nothing fits" in out
    assert "skipped 2 candidate(s)" in out and "no repeated blocks" in out  # checkpoint=full needs blocks
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    assert data["best"] is None and not data["fits"] and len(data["candidates"]) == 2
    assert {s["label"] for s in data["skipped"]} == {"8x1 fp32 full adamw", "8x1 fp32 full adamw_8bit"}


def test_module_target_and_bad_targets(capsys):
    rc = run_cli(["memwrap.models:GPT", "--input-shape", "2,16", "--input-dtype", "long", "--input-high", "50257",
                  "--budget", "80GiB", "--checkpoints", "none", "--precisions", "bf16", "--optimizers", "adamw",
                  "--micro-batches", "2", "--quiet"])
    assert rc == 0 and "accumulate=1" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="package.module:factory"):
        run_cli(["memwrap.models", "--input-shape", "2,16", "--budget", "1GiB"])
    with pytest.raises(SystemExit, match="Did you mean 'GPT'"):
        run_cli(["memwrap.models:GTP", "--input-shape", "2,16", "--budget", "1GiB"])
    with pytest.raises(SystemExit, match="input-shape"):
        run_cli(["memwrap.models:GPT", "--budget", "1GiB"])
    with pytest.raises(SystemExit, match="Valid presets"):
        run_cli(["--preset", "llama-8b", "--budget", "1GiB"])


def test_bad_budget_exits_2_with_accepted_forms(capsys):
    assert run_cli(["--preset", "llama-tiny", "--budget", "lots", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "24GiB" in err and "24GB" in err


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * 2**30), ("24 GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("24 GB", 24 * 10**9),
    (25769803776, 25769803776), ("1.5 TiB", int(1.5 * 2**40)), ("512MiB", 512 * 2**20), ("24G", 24 * 2**30),
    ("100", 100), (" 2gib ", 2 * 2**30),
])
def test_parse_budget_accepts(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["lots", "24 GiBs", "-1GB", "0", 0, -5, "GB", "1e9", "", None, True, [24]])
def test_parse_budget_rejects_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="Accepted|accepted") as info:
        parse_budget(bad)
    assert "GiB" in str(info.value)


def test_parse_budget_suggests_a_unit():
    with pytest.raises(ValueError, match="Did you mean unit 'gib'"):
        parse_budget("24 gibb")
