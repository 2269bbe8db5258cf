"""A small pure-torch model zoo whose module trees mirror the real architectures.

Used by the tests, the memory planner, the demo and the benchmarks, so that none of them
needs ``transformers`` or a download. Attribute names follow the reference implementations
(HF GPT-2 / LLaMA / BERT, torchvision ResNet) so that block detection, checkpoint policies
and parameter counts behave as they would on the real models.

Example::

    >>> from memwrap.models import build_preset, preset_batch, lm_loss
    >>> model = build_preset("gpt2-tiny")
    >>> x, y = preset_batch("gpt2-tiny", batch_size=2, seq_len=16)
    >>> lm_loss(model(x), y).backward()

Big presets can be inspected without allocating memory::

    >>> with torch.device("meta"):
    ...     m = build_preset("llama-7b")
    >>> sum(p.numel() for p in m.parameters())
    6738415616
"""

from __future__ import annotations

import torch  # noqa: F401  (used by the doctest above)

from memwrap.models.common import lm_loss, classification_loss, causal_lm_loss, LMOutput
from memwrap.models.gpt import GPTConfig, GPT, GPTBlock
from memwrap.models.llama import LlamaConfig, Llama, LlamaDecoderLayer
from memwrap.models.bert import BertConfig, Bert, BertLayer
from memwrap.models.resnet import ResNetConfig, ResNet, Bottleneck
from memwrap.models.presets import PresetSpec, PRESETS, build_preset, preset_batch, preset_names, get_preset

__all__ = [
    "GPTConfig",
    "GPT",
    "GPTBlock",
    "LlamaConfig",
    "Llama",
    "LlamaDecoderLayer",
    "BertConfig",
    "Bert",
    "BertLayer",
    "ResNetConfig",
    "ResNet",
    "Bottleneck",
    "PresetSpec",
    "PRESETS",
    "build_preset",
    "preset_batch",
    "preset_names",
    "get_preset",
    "lm_loss",
    "classification_loss",
    "causal_lm_loss",
    "LMOutput",
]
