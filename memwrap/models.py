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

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig", "GPT", "GPTBlock", "LlamaConfig", "Llama", "LlamaDecoderLayer", "BertConfig", "Bert",
    "BertLayer", "ResNetConfig", "ResNet", "Bottleneck", "PresetSpec", "PRESETS", "build_preset",
    "preset_batch", "preset_names", "get_preset", "lm_loss", "classification_loss",
]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy for ``[B, T, V]`` logits and ``[B, T]`` targets (mean over tokens)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy for ``[B, C]`` logits and ``[B]`` integer labels."""
    return F.cross_entropy(logits.float(), targets)


def _normal_init(module: nn.Module, std: float) -> None:
    # One init rule for every family keeps the zoo simple; the exact scheme is irrelevant for
    # memory/gradient experiments, but small std keeps tiny models numerically tame.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


# --------------------------------------------------------------------------- GPT-2

@dataclass
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout_p = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.attn_dropout_p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (pre-LN, learned positions, lm_head tied to ``transformer.wte``)."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or GPTConfig()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(lambda m: _normal_init(m, 0.02))
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}; "
                             f"shorten the input or build with block_size>={t}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# --------------------------------------------------------------------------- LLaMA

@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        # Not persistent: derived from the config, so it stays out of state_dict as in HF.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = (z.to(q.dtype) for z in position_embeddings)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, *, position_embeddings) -> torch.Tensor:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.hidden_size // cfg.num_attention_heads, cfg.rope_theta)


class Llama(nn.Module):
    """LLaMA (RMSNorm, rotary positions, SwiGLU, no biases, untied ``lm_head``)."""

    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or LlamaConfig()
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(lambda m: _normal_init(m, 0.02))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {t} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}; shorten the input")
        x = self.model.embed_tokens(input_ids)
        pe = self.model.rotary_emb(t, x.device)
        for layer in self.model.layers:
            # Passed by keyword on purpose: checkpoint policies must forward kwargs.
            x = layer(x, position_embeddings=pe)
        return self.lm_head(self.model.norm(x))


# --------------------------------------------------------------------------- BERT

@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    num_labels: int = 2
    head: str = "classification"  # or "mlm"


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_head = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (lin(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for lin in (self.query, self.key, self.value))
        p = self.dropout_p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=p)
        return y.transpose(1, 2).reshape(b, t, c)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + x)  # post-LN


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(self.self(x, attention_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertOutput(BertSelfOutput):
    def __init__(self, cfg: BertConfig):
        super().__init__(cfg)
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attention(x, attention_mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertPooler(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class BertMLMHead(nn.Module):
    def __init__(self, cfg: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)
        self.decoder.weight = word_embeddings.weight  # tied, as in BERT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.LayerNorm(F.gelu(self.dense(x))))


class Bert(nn.Module):
    """BERT (post-LN). ``head="classification"`` gives ``[B, num_labels]``; ``head="mlm"`` gives ``[B, T, V]``."""

    def __init__(self, cfg: BertConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or BertConfig()
        if cfg.head not in ("classification", "mlm"):
            raise ValueError(f"BertConfig.head={cfg.head!r} is not valid; use 'classification' or 'mlm'")
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)
        if cfg.head == "mlm":
            self.cls = BertMLMHead(cfg, self.embeddings.word_embeddings)
        else:
            self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        self.apply(lambda m: _normal_init(m, 0.02))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        mask = None
        if attention_mask is not None:  # [B, T] of 1/0 -> boolean [B, 1, 1, T] (True = attend)
            mask = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, attention_mask=mask)
        if self.config.head == "mlm":
            return self.cls(x)
        return self.classifier(self.dropout(self.pooler(x)))


# --------------------------------------------------------------------------- ResNet

@dataclass
class ResNetConfig:
    layers: tuple[int, ...] = (3, 4, 6, 3)
    num_classes: int = 1000
    width: int = 64


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision-shaped ResNet of Bottleneck blocks (ResNet-50 with the default config)."""

    def __init__(self, cfg: ResNetConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or ResNetConfig()
        w = cfg.width
        self.inplanes = w
        self.conv1 = nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        for i, n in enumerate(cfg.layers):
            setattr(self, f"layer{i + 1}", self._make_layer(w * 2 ** i, n, stride=1 if i == 0 else 2))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.inplanes, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(len(self.config.layers)):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


# --------------------------------------------------------------------------- presets

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
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(inputs, targets)`` of the right kind for preset ``name``.

    ``seq_len`` is the token count for text models (default: the model's context length) and the
    image side for image models (default 224).

    Example: ``x, y = preset_batch("resnet50", 2, seq_len=64)`` gives ``x.shape == (2, 3, 64, 64)``.
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
        return torch.randint(0, v, (batch_size, t), **kw), torch.randint(0, v, (batch_size, t), **kw)
    n_classes = getattr(spec.config, "num_labels", None) or spec.config.num_classes
    labels = torch.randint(0, n_classes, (batch_size,), **kw)
    if spec.kind == "image":
        return torch.randn(batch_size, 3, t, t, **kw), labels
    return torch.randint(0, spec.vocab_size, (batch_size, t), **kw), labels
