"""Named presets with the real parameter counts, and example batches of the right kind."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from memwrap.models.bert import Bert, BertConfig
from memwrap.models.common import classification_loss, lm_loss
from memwrap.models.gpt import GPT, GPTConfig
from memwrap.models.llama import Llama, LlamaConfig
from memwrap.models.resnet import ResNet, ResNetConfig


@dataclass(frozen=True)
class PresetSpec:
    """A named model: its class, config, the parameter count of the real model, its data kind and loss.

    ``kind`` is ``"lm"`` (inputs/targets ``[B, T]`` token ids), ``"classification"`` (``[B, T]`` ids,
    ``[B]`` labels) or ``"image"`` (``[B, 3, S, S]`` images, ``[B]`` labels).
    """

    name: str
    model_cls: type[nn.Module]
    config: object
    params: int
    kind: str
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    description: str = ""

    @property
    def default_seq_len(self) -> int:
        c = self.config
        return getattr(c, "block_size", None) or getattr(c, "max_position_embeddings", None) or 224

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.config, "vocab_size", None)

    def factory(self, **overrides) -> nn.Module:
        fields = {f.name for f in dataclasses.fields(self.config)}
        for key in overrides:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"preset {self.name!r} has no config field {key!r}.{hint} "
                                f"Valid fields: {', '.join(sorted(fields))}")
        return self.model_cls(dataclasses.replace(self.config, **overrides))


def _gpt(name, n_layer, n_head, n_embd, params, desc, **kw) -> PresetSpec:
    return PresetSpec(name, GPT, GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, **kw), params, "lm",
                      lm_loss, desc)


PRESETS: dict[str, PresetSpec] = {s.name: s for s in [
    _gpt("gpt2", 12, 12, 768, 124_439_808, "GPT-2 small"),
    _gpt("gpt2-medium", 24, 16, 1024, 354_823_168, "GPT-2 medium"),
    _gpt("gpt2-large", 36, 20, 1280, 774_030_080, "GPT-2 large"),
    _gpt("gpt2-xl", 48, 25, 1600, 1_557_611_200, "GPT-2 XL"),
    _gpt("gpt2-tiny", 4, 4, 256, 4_273_664, "CPU-sized GPT-2 for tests and demos",
         vocab_size=4096, block_size=256),
    PresetSpec("llama-7b", Llama, LlamaConfig(), 6_738_415_616, "lm", lm_loss, "LLaMA-1/2 7B"),
    PresetSpec("llama-2-70b", Llama, LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                                 num_attention_heads=64, num_key_value_heads=8,
                                                 max_position_embeddings=4096),
               68_976_648_192, "lm", lm_loss, "Llama-2 70B (grouped-query attention, 8 KV heads)"),
    PresetSpec("llama-3-8b", Llama, LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
               8_030_261_248, "lm", lm_loss,
               "Llama-3 8B (vocabulary 128256, grouped-query attention with 8 KV heads, untied embeddings)"),
    PresetSpec("llama-tiny", Llama, LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                                                 num_hidden_layers=4, num_attention_heads=4,
                                                 max_position_embeddings=256),
               5_261_568, "lm", lm_loss, "CPU-sized LLaMA for tests and demos"),
    PresetSpec("bert-large", Bert, BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                              intermediate_size=4096), 335_143_938, "classification",
               classification_loss, "BERT-large with a 2-way classification head"),
    PresetSpec("bert-tiny", Bert, BertConfig(vocab_size=4096, hidden_size=128, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=512,
                                             max_position_embeddings=256),
               970_882, "classification", classification_loss, "CPU-sized BERT for tests"),
    PresetSpec("resnet50", ResNet, ResNetConfig(), 25_557_032, "image", classification_loss, "ResNet-50"),
]}


def preset_names() -> list[str]:
    """Names accepted by :func:`build_preset`, e.g. ``['gpt2', 'gpt2-medium', ...]``."""
    return list(PRESETS)


def get_preset(name: str) -> PresetSpec:
    """The :class:`PresetSpec` called ``name``; an unknown name raises listing the valid ones.

    Example: ``get_preset("gpt2").params == 124_439_808``.
    """
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name), PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model preset {name!r}.{hint} Valid presets: {', '.join(PRESETS)}") from None


def build_preset(name: str, **config_overrides) -> nn.Module:
    """Build preset ``name``; keyword arguments override fields of its config dataclass.

    Build under ``with torch.device("meta"):`` to inspect a big model without allocating it.

    Example: ``build_preset("gpt2-tiny", n_layer=2, dropout=0.1)``.
    """
    return get_preset(name).factory(**config_overrides)


def preset_batch(name: str, batch_size: int, seq_len: int | None = None, device="cpu",
                 generator: torch.Generator | None = None, labels: bool = False) -> Any:
    """Random ``(inputs, targets)`` of the right kind for preset ``name``.

    ``seq_len`` is the token count for text models (default: the model's context length) and the
    image side for image models (default 224).

    ``labels=True`` (text models): a dict of keyword arguments for the model's forward, the input ids under the
    forward's first parameter name and ``labels`` (the same ids, shifted inside the model, Hugging Face style),
    so the model computes its own loss (what ``chunked_loss`` replaces).

    Example: ``x, y = preset_batch("resnet50", 2, seq_len=64)`` gives ``x.shape == (2, 3, 64, 64)``;
    ``preset_batch("llama-tiny", 2, 16, labels=True).keys()`` is ``dict_keys(['input_ids', 'labels'])``.
    """
    spec = get_preset(name)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    t = spec.default_seq_len if seq_len is None else seq_len
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"seq_len must be a positive int or None, got {seq_len!r}")
    if spec.kind != "image" and t > spec.default_seq_len:
        raise ValueError(f"seq_len={t} exceeds the context length {spec.default_seq_len} of preset {name!r}")
    kw = dict(device=device, generator=generator)
    if spec.kind == "lm":
        v = spec.vocab_size
        if labels:
            import inspect

            first = list(inspect.signature(spec.model_cls.forward).parameters)[1]  # after self: idx / input_ids
            ids = torch.randint(0, v, (batch_size, t), **kw)
            return {first: ids, "labels": ids}
        return torch.randint(0, v, (batch_size, t), **kw), torch.randint(0, v, (batch_size, t), **kw)
    n_classes = getattr(spec.config, "num_labels", None) or spec.config.num_classes
    labels = torch.randint(0, n_classes, (batch_size,), **kw)
    if spec.kind == "image":
        return torch.randn(batch_size, 3, t, t, **kw), labels
    return torch.randint(0, spec.vocab_size, (batch_size, t), **kw), labels
