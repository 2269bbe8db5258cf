"""`memwrap demo` end to end, the benchmark scripts' CPU paths (gpu_check --dry-run, seed_claims --fast)."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memwrap.cli import main
from memwrap.demo.runner import Batches, _budget
from memwrap.demo.corpus import CORPUS, corpus_tokens
from benchmark_loading import load_benchmark



_load = load_benchmark  # tests/benchmark_loading.py


def test_demo_end_to_end(tmp_path, capsys):
    png, js = tmp_path / "demo.png", tmp_path / "demo.json"
    rc = main(["demo", "--batch", "4", "--seq", "128", "--steps", "3", "--budget", "80%", "--out", str(png),
               "--json", str(js), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(js.read_text())
    plain, planned = report["runs"]
    # The budget is 80% of the plain prediction: plain does not fit, the planned configuration does.
    assert report["budget"] < plain["predicted"]["total"]
    assert planned["predicted"]["total"] < report["budget"]
    assert planned["options"] != {} and planned["options"] != plain["options"]
    for run in report["runs"]:
        # Measured (CPU allocator, independent of the fake trace) within 10% of the prediction.
        assert abs(run["measured_peak"] / run["predicted"]["total"] - 1) <= 0.10
        # Measured persistent categories equal the predicted ones exactly.
        for cat in ("parameters", "optimizer_state"):
            assert run["tracked"][cat] == run["predicted"][cat]
    assert not plain["fits_budget"] and planned["fits_budget"]
    # Same initial weights and batches, fp32 AdamW both times: the losses agree to float rounding.
    assert plain["losses"][0] == pytest.approx(planned["losses"][0], rel=1e-5)
    assert report["max_loss_diff"] < 1e-3
    assert plain["losses"][-1] < plain["losses"][0]


def test_demo_prints_the_comparison(tmp_path, capsys):
    rc = main(["demo", "--batch", "2", "--seq", "16", "--steps", "3", "--budget", "1GiB", "--checkpoints", "none",
               "--out", ""])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("1. plan", "2. train", "3. results", "measured / predicted", "s / update", "within 10%: yes"):
        assert text in out


@pytest.mark.parametrize("argv, message", [
    (["--preset", "bert-tiny"], "Valid: gpt2"),
    (["--preset", "gpt2-tinny"], "Did you mean 'gpt2-tiny'"),
    (["--steps", "2"], "at least 3"),
    (["--seq", "100000"], "takes 1 to 256 tokens"),
    (["--budget", "lots%"], "a percentage must be a number"),
])
def test_demo_bad_input_names_the_fix(argv, message, capsys):
    assert main(["demo", *argv, "--out", ""]) == 2
    assert message in capsys.readouterr().err


@settings(max_examples=25, deadline=None)
@given(batch=st.sampled_from([1, 2, 4, 6, 8, 12]), seq=st.integers(1, 64), step=st.integers(0, 1000),
       seed=st.integers(0, 50), data=st.data())
def test_batches_split_a_global_batch_exactly(batch, seq, step, seed, data):
    # The plain run takes micro(step, 0, batch); an accumulating run takes micro(step, i, m) for i < batch / m.
    m = data.draw(st.sampled_from([d for d in range(1, batch + 1) if batch % d == 0]))
    b = Batches(corpus_tokens(), batch=batch, seq=seq, seed=seed)
    x, y = b.micro(step, 0, batch)
    parts = [b.micro(step, i, m) for i in range(batch // m)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    assert x.shape == (batch, seq) and torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
    text = CORPUS.encode()
    for row, target in zip(x.tolist(), y.tolist()):  # every row is a window of the corpus
        assert bytes(row + target[-1:]) in text


def test_demo_budget_percentages_are_relative_to_the_plain_peak():
    assert _budget("60%", 100 * 2**20) == (60 * 2**20, "60.00 MiB (60% of the plain run's predicted peak)")
    assert _budget("100MiB", 1)[0] == 100 * 2**20
    with pytest.raises(ValueError, match="Accepted"):
        _budget("lots", 1)


def test_gpu_check_dry_run_on_cpu(tmp_path):
    gpu_check = _load("gpu_check")
    # All but the two slowest timing checks (fp16/bf16 matmuls and ResNet-50 are slow on CPU; they share
    # train() with the others, and benchmarks/gpu_check.py --dry-run runs them all in about 25 s).
    names = [n for n in gpu_check.CHECKS if n not in ("precision_step_time", "accumulation_overhead")]
    rc = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", ",".join(names)])
    doc = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert rc == 0, doc["failed"]
    assert list(doc["checks"]) == names
    assert all(c["status"] in ("ok", "skipped") for c in doc["checks"].values()), doc["checks"]
    planner = doc["checks"]["planner_vs_cuda"]
    assert planner["target"] == 0.10 and {r["model"] for r in planner["rows"]} == {"gpt2-tiny", "resnet50"}
    for row in planner["rows"]:  # 8-bit AdamW too: its CPU step temporaries are probed per parameter role
        assert "known_gap" not in row and abs(row["ratio"] - 1) <= 0.10, row
    zoo = doc["checks"]["zoo_cuda"]  # the zoo's cells, measured on the check's device (CPU in the dry run)
    assert zoo["measured"] == zoo["cells"] == 2 and all(abs(r["error"]) <= 0.05 for r in zoo["rows"]), zoo
    assert doc["suggested_margin"] is None  # it needs CUDA's reserved bytes
    # The figures seed_claims.py reads from a GPU run exist under the names it reads.
    checks = doc["checks"]
    assert checks["checkpoint_overhead"]["overhead_full_pct"] > -100
    assert checks["wrapped_vs_handwritten"]["max_weight_diff"] < 1e-3
    assert checks["wrapped_vs_handwritten"]["update_rel_diff"] < 1e-2
    assert doc["complete"] and doc["pending"] == []
    assert not (tmp_path / "gpu_check.json").exists()  # a dry run never poses as GPU results


def test_gpu_check_records_a_failure_and_goes_on(tmp_path, monkeypatch):
    gpu_check = _load("gpu_check")

    def broken(setup):
        raise AssertionError("deliberately broken")

    seen = {}

    def peek(setup):  # what a run killed now, by a timeout, would leave on disk
        seen.update(json.loads((tmp_path / "gpu_check_dry_run.json").read_text()))
        return {}

    monkeypatch.setitem(gpu_check.CHECKS, "bf16", (broken, True))
    monkeypatch.setitem(gpu_check.CHECKS, "tf32", (peek, True))
    rc = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "bf16,tf32"])
    doc = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert rc == 1 and doc["failed"] == ["bf16"] and doc["complete"]
    assert doc["checks"]["tf32"]["status"] == "ok"
    assert "deliberately broken" in doc["checks"]["bf16"]["error"]
    assert seen["failed"] == ["bf16"] and seen["pending"] == ["tf32"] and not seen["complete"]


def test_gpu_check_records_an_import_failure(tmp_path, monkeypatch):
    gpu_check = _load("gpu_check")
    monkeypatch.setattr(gpu_check, "IMPORT_ERROR", "ImportError: no module named memwrap.models")
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert doc["failed"] == ["import"] and "memwrap.models" in doc["import_error"]


def test_seed_claims_fast_has_a_row_per_claim(tmp_path):
    seed_claims = _load("seed_claims")
    rows_mod = sys.modules["seed_claims_rows"]
    assert seed_claims.main(["--fast", "--out", str(tmp_path), "--gpu-json", str(tmp_path / "none.json")]) == 0
    doc = json.loads((tmp_path / "seed_claims.json").read_text())
    ids = [r["id"] for r in doc["rows"]]
    assert ids == [c["id"] for c in rows_mod.CLAIMS] and len(set(ids)) == len(ids)
    by_id = {r["id"]: r for r in doc["rows"]}
    for r in doc["rows"]:
        assert r["kind"] in seed_claims.KINDS and r["measured"] and r["setting"] and r["quote"]
        assert not r["measured"].startswith("measurement failed"), r
    # Exact facts that do not depend on the preset size.
    assert by_id["adamw-8-bytes"]["figures"]["value"] == pytest.approx(8.0, abs=1e-3)
    assert by_id["grads-4-bytes"]["figures"]["value"] == pytest.approx(4.0, abs=1e-6)
    assert by_id["image-batch-150mb"]["figures"]["value"] == pytest.approx(32 * 3 * 224 * 224 * 4 / 1e6, abs=0.1)
    assert by_id["amp-2-3x-speed"]["kind"] == "needs a GPU to measure"  # no GPU JSON given
    assert (tmp_path / "seed_claims.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 1 |" in (tmp_path / "seed_claims.md").read_text()


def test_seed_claims_time_rows_use_gpu_results():
    _load("seed_claims")
    rows_mod = sys.modules["seed_claims_rows"]
    gpu = {"device": "H200", "checks": {"precision_step_time": {"status": "ok", "speedup_bf16_vs_fp32": 2.4},
                                        "checkpoint_overhead": {"status": "failed", "overhead_full_pct": 25.0}}}
    ctx = rows_mod.Ctx(fast=True, gpu=gpu)
    row = rows_mod.amp_speed(ctx)
    assert row["kind"] == "holds" and row["figures"]["value"] == 2.4 and "H200" in row["setting"]
    ctx.gpu["checks"]["precision_step_time"]["speedup_bf16_vs_fp32"] = 1.3
    assert rows_mod.amp_speed(ctx)["kind"] == "does not hold"
    ctx.gpu["checks"]["precision_step_time"]["speedup_bf16_vs_fp32"] = 3.5  # faster than claimed is not a miss
    row = rows_mod.amp_speed(ctx)
    assert row["kind"] == "holds" and row["verdict"].startswith("better than claimed")
    ctx.gpu["checks"]["precision_step_time"]["speedup_bf16_vs_fp32"] = 1.95  # inside the 0.1x noise band
    assert rows_mod.amp_speed(ctx)["verdict"].startswith("within the noise band")
    failed = rows_mod.ckpt_time(ctx)
    assert failed["kind"] == "needs a GPU to measure"  # a failed check is not a measurement
    assert "failed" in failed["measured"] and "no GPU result" not in failed["measured"]
    ctx.gpu["checks"]["checkpoint_overhead"] = {"status": "ok", "overhead_full_pct": 10.0, "setting": "gpt2, 8 x 512"}
    row = rows_mod.ckpt_time(ctx)  # an overhead below the claimed 20-30% is better, not a miss
    assert row["kind"] == "holds" and row["verdict"].startswith("better") and "gpt2, 8 x 512" in row["setting"]
    ctx.gpu["checks"]["checkpoint_overhead"]["overhead_full_pct"] = 40.0
    assert rows_mod.ckpt_time(ctx)["kind"] == "does not hold"


def test_gpu_check_suggests_the_margin_its_measurements_call_for():
    gpu_common = _load("gpu_common")
    mib = 2**20
    doc = {"outside_allocator_at_start": 500 * mib,
           "checks": {"planner_vs_cuda": {"outside_allocator": 700 * mib, "rows": [
               {"options": {}, "predicted": 1000 * mib, "measured": 1010 * mib, "reserved": 1070 * mib},
               {"options": {"precision": "bf16"}, "predicted": 800 * mib, "measured": 790 * mib, "reserved": 880 * mib},
           ]}}}
    m = gpu_common.suggest_margin(doc)
    # 880 / 800 = 1.10 is the worst reserved / predicted; 700 MiB rounds up to 704 MiB (11 x 64 MiB)
    assert m["fraction"] == 0.10 and m["fixed"] == 704 * mib and m["from_row"] == {"precision": "bf16"}
    budget_needed = [r["reserved"] + 700 * mib for r in doc["checks"]["planner_vs_cuda"]["rows"]]
    assert all(r["predicted"] * (1 + m["fraction"]) + m["fixed"] >= need
               for r, need in zip(doc["checks"]["planner_vs_cuda"]["rows"], budget_needed))
    assert gpu_common.suggest_margin({"checks": {}}) is None
