"""The memory ladder on a lent GPU (issue 12 item 8), a check of ``benchmarks/gpu_check.py``.

Each row of ``benchmarks/ladder.py``'s ladder (fp32 AdamW, + bf16-true, + checkpointing, + paged 8-bit AdamW,
+ step in backward, + chunked loss) on a ~1B-parameter Llama (hidden 2048, 16 layers, vocabulary 32000;
1.07 B parameters) at batch 2 x 1024: ``torch.cuda.max_memory_allocated`` against the fake-tensor prediction
(paged state excluded from both: bitsandbytes allocates it with ``cudaMallocManaged``, outside torch's
allocator, which is exactly why the planner reports it apart) and tokens/s per row. Then, if time is left,
llama-3-8b with the last row, capped with ``torch.cuda.set_per_process_memory_fraction`` at 24 GiB: the
claim that it trains inside a 24 GiB card, measured. The whole check stays within about 4 minutes on an
H100/H200 (``budget_s``); rows not reached are listed as such. ``--dry-run``: a tiny Llama on the CPU.
"""
from __future__ import annotations

import time
from typing import Any

import torch

GIB = 2**30
TOLERANCE = 0.10  # measured/predicted; the CUDA allocator rounds blocks and cuBLAS workspaces are outside the trace


def _ladder():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ladder import LADDER

    return LADDER


def _config(dry: bool):
    from memwrap.models import LlamaConfig

    if dry:
        return LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), 2, 64
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048), 2, 1024


def _on(device: torch.device, build, dtype: torch.dtype | None = None):
    """``build`` made directly on ``device`` (initialised there: fast on a GPU, no host copy), in ``dtype``."""
    def made():
        previous = torch.get_default_dtype()
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                return build()
        finally:
            torch.set_default_dtype(previous)
    return made


def _row(build, data, opts: dict, device: torch.device, steps: int, dtype: torch.dtype | None = None) -> dict[str, Any]:
    import memwrap
    from memwrap.memory import measure_peak

    est = memwrap.estimate(build, data, **opts)  # built on the meta device: nothing allocated
    got = measure_peak(_on(device, build, dtype), data, steps=steps, device=device, **opts)
    out = {"predicted": est.peak, "paged_state": est.paged_state, "measured": got["peak"],
           "reserved": got.get("reserved"), "method": got["method"]}
    if device.type == "cpu":  # no unified memory: bitsandbytes' paged state is ordinary memory here
        out["predicted"] += est.paged_state
    out["ratio"] = out["measured"] / out["predicted"]
    return out


def _tokens_per_s(build, data, opts: dict, device: torch.device, updates: int) -> float:
    import memwrap

    opts = dict(opts)
    torch.manual_seed(0)
    model = _on(device, build)()
    optimizer = memwrap.create_optimizer(opts.pop("optim"), model)
    model, optimizer = memwrap.wrap(model, optimizer, **opts)
    batch = {k: v.to(device) for k, v in data.items()}

    def update():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    update()  # warm-up: state, allocator, autotuning
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(updates):
        update()
    if device.type == "cuda":
        torch.cuda.synchronize()
    tokens = batch["input_ids"].numel() * updates
    del model, optimizer
    return tokens / (time.perf_counter() - t0)


def check_ladder(s: Any, budget_s: float = 240.0) -> dict:
    """Per ladder row: predicted vs measured peak and tokens/s; then the 8B row under a 24 GiB cap if time is left.

    ``s`` is gpu_check's ``Setup`` (``s.dry``, ``s.device``).
    """
    from memwrap.models import Llama

    start = time.perf_counter()
    cfg, batch, seq = _config(s.dry)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    data = {"input_ids": ids, "labels": ids}

    def build():
        torch.manual_seed(0)
        return Llama(cfg)

    rows, bad, not_reached = [], [], []
    for name, opts in _ladder():
        if time.perf_counter() - start > 0.75 * budget_s:  # the rest of the budget is the 8B row's
            not_reached.append(name)
            continue
        try:
            row = _row(build, data, opts, s.device, steps=1)
            row["tokens_per_s"] = _tokens_per_s(build, data, opts, s.device, updates=2 if s.dry else 5)
        except Exception as exc:  # noqa: BLE001 - one row's failure (e.g. bitsandbytes' CUDA library) is reported
            rows.append({"row": name, "options": opts, "status": "failed", "error": f"{type(exc).__name__}: {exc}"})
            bad.append(name)
            continue
        row.update(row=name, options=opts)
        rows.append(row)
        if not s.dry and abs(row["ratio"] - 1) > TOLERANCE:
            bad.append((name, round(row["ratio"], 3)))
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
    out: dict[str, Any] = {"model": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                                     "vocab": cfg.vocab_size, "batch": batch, "seq": seq},
                           "rows": rows, "target": TOLERANCE, "not_reached": not_reached}
    if not s.dry and time.perf_counter() - start < 0.8 * budget_s:
        out["llama_3_8b_24GiB"] = _eight_b_capped(s.device)
    elif not s.dry:
        out["llama_3_8b_24GiB"] = {"status": "not reached: the ladder rows used the time budget"}
    if bad:
        out.update(status="failed", error=f"rows outside {TOLERANCE:.0%} or failed: {bad}")
    return out


def _eight_b_capped(device: torch.device) -> dict:
    """llama-3-8b, batch 2 x 2048, every technique, with the process capped at 24 GiB of this GPU."""
    from memwrap.models import build_preset, preset_batch

    name, opts = _ladder()[-1]
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, 24 * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        data = preset_batch("llama-3-8b", 2, 2048, labels=True)
        # Built in bf16 on the GPU: an fp32 copy of 8B parameters (30 GiB) would not fit under the cap, and
        # bf16-true stores bf16 anyway (its conversion is then a no-op).
        row = _row(lambda: build_preset("llama-3-8b"), data, opts, device, steps=1, dtype=torch.bfloat16)
        row.update(row=name, options=opts, cap_fraction=fraction, status="ok")
        return row
    except torch.cuda.OutOfMemoryError as exc:
        return {"row": name, "status": "out of memory under the 24 GiB cap", "error": str(exc)[:300]}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
