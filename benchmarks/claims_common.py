"""Shared pieces of the seed-claim measurements: the context (fast mode, GPU results, cached
estimates) and the helpers that format a row. See ``seed_claims_rows.py`` for the row format."""
from __future__ import annotations

from typing import Any

import memwrap
from memwrap.memory import format_bytes
from memwrap.models import get_preset, preset_batch

S0, S1 = "000 (HF accumulation + checkpointing)", "001 (PyTorch gradient accumulation)"
GIB = 2**30
CARD_24 = 24 * GIB  # a "24 GB" RTX 3090 / 4090 has 24 GiB
CARD_12 = 12 * GIB  # RTX 3060 12 GB


class Ctx:
    """Shared state: fast mode (tiny presets), the GPU results, a cache of estimates."""

    TINY = {"gpt2": "gpt2-tiny", "bert-large": "bert-tiny", "resnet50": "resnet50", "llama-7b": "llama-tiny"}

    def __init__(self, fast: bool = False, gpu: dict | None = None):
        self.fast, self.gpu = fast, gpu
        self._cache: dict = {}

    def name(self, preset: str) -> str:
        return self.TINY.get(preset, preset) if self.fast else preset

    def seq(self, preset: str, seq: int) -> int:
        if self.fast:
            return 32
        return seq

    def est(self, preset: str, batch: int, seq: int, **options: Any):
        """``memwrap.estimate`` of ``preset`` at micro-batch ``batch`` (cached)."""
        name, seq = self.name(preset), self.seq(preset, seq)
        key = (name, batch, seq, tuple(sorted(options.items())))
        if key not in self._cache:
            spec = get_preset(name)
            self._cache[key] = memwrap.estimate(spec.factory, preset_batch(name, batch, seq), loss_fn=spec.loss,
                                                **options)
        return self._cache[key]

    def where(self, preset: str, batch: int, seq: int, **options: Any) -> str:
        name, seq = self.name(preset), self.seq(preset, seq)
        unit = "px" if get_preset(name).kind == "image" else "tokens"
        opts = ", ".join(f"{k}={v}" for k, v in options.items()) or "fp32, AdamW"
        return f"{name}, micro-batch {batch} x {seq} {unit}, {opts}"

    def gpu_check(self, name: str) -> dict | None:
        if not self.gpu:
            return None
        check = self.gpu.get("checks", {}).get(name)
        return check if check and check.get("status") == "ok" else None


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def change(reduction: float) -> str:
    """A reduction as a signed change: 0.17 -> '-17%', -0.05 -> '+5%'."""
    return f"{-100 * reduction:+.0f}%"


def gib(n: float) -> str:
    return format_bytes(n)


def _reduction(before, after) -> float:
    return 1 - after.peak / before.peak


def _row(setting, measured, kind, verdict, figures=None, fix=None) -> dict:
    out = {"setting": setting, "measured": measured, "kind": kind, "verdict": verdict, "figures": figures or {}}
    if fix:
        out["fix"] = fix
    return out
