"""The model families the time predictor is traced and measured on.

Transformer stacks follow Megatron-Core's layer structure (fused QKV, column-parallel fc1 /
row-parallel fc2), so building one at ``tp=k`` gives exactly the per-rank shard a TP rank runs:
local heads ``heads/k``, local FFN width ``ffn/k``, local vocabulary ``vocab/k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from predictors.spec import TransformerSpec
from predictors.step import Batch

TRANSFORMER_FAMILIES = ("gpt", "llama", "bert")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _SequenceGather(torch.autograd.Function):
    """Sequence parallelism's all-gather of the ``seq / tp`` shards before the column-parallel
    GEMMs (backward: reduce-scatter). The collective's bytes are the network model's; here only
    its full-length output appears, as an allocation (no kernel is traced for it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.tp = tp
        b, s, h = x.shape
        return x.new_empty(b, s * tp, h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b, s, h = grad.shape
        return grad.new_empty(b, s // ctx.tp, h), None


class _SequenceScatter(torch.autograd.Function):
    """Sequence parallelism's reduce-scatter after the row-parallel GEMMs (backward:
    all-gather): what follows (dropout, residual add, norm) runs on ``seq / tp`` tokens."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.tp = tp
        b, s, h = x.shape
        return x.new_empty(b, s // tp, h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b, s, h = grad.shape
        return grad.new_empty(b, s * ctx.tp, h), None


class TransformerLayer(nn.Module):
    """One TP shard of a GPT (pre-LN, GELU), Llama (RMSNorm, RoPE, GQA, SwiGLU) or BERT
    (post-LN, bidirectional) layer. With ``sequence_parallel`` (Megatron's
    ``--sequence-parallel``, torchtitan's TP plan) the layer's input and output are the rank's
    ``seq / tp`` tokens: norms, dropout and residual adds run on that shard, the attention and
    MLP on the gathered sequence."""

    def __init__(self, spec: TransformerSpec, tp: int = 1, dropout: float | None = None,
                 sequence_parallel: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp > 1
        self.family = spec.family
        self.attention = spec.attention
        h = spec.hidden_size
        self.head_dim = h // spec.num_attention_heads
        self.heads = spec.num_attention_heads // tp
        self.kv_heads = spec.kv_heads // tp
        llama = spec.family == "llama"
        bias = not llama
        norm = (lambda: RMSNorm(h)) if llama else (lambda: nn.LayerNorm(h))
        self.norm1, self.norm2 = norm(), norm()
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv = nn.Linear(h, qkv_out, bias=bias)
        self.proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        ffn = spec.ffn // tp
        self.swiglu = spec.swiglu or llama
        self.fc1 = nn.Linear(h, 2 * ffn if self.swiglu else ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, h, bias=bias)
        self.dropout = (0.0 if llama else 0.1) if dropout is None else dropout
        if llama:
            inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
            freqs = torch.outer(torch.arange(spec.seq_length).float(), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return _SequenceGather.apply(x, self.tp) if self.sequence_parallel else x

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _SequenceScatter.apply(x, self.tp) if self.sequence_parallel else x

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        x = self._gather(x)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim,
             self.kv_heads * self.head_dim], dim=-1,
        )  # fmt: skip
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.family == "llama":
            cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.attention == "unfused":
            o = self._unfused_attention(q, k, v)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.family != "bert")
        o = self.proj(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        return F.dropout(self._reduce(o), self.dropout, self.training)

    def _unfused_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Megatron's classic core attention, as vTrain's own GPT model runs it (VIA-Research/
        vTrain, src/model/gpt_modeling.py, ShardedGptSelfAttention): baddbmm scores over the
        whole [s, s] (no causal tile skipping), FusedScaleMaskSoftmax (scale and causal mask
        in the softmax kernel's one pass), dropout on the probabilities, bmm with v."""
        b, n, s, d = q.shape
        # one copy per operand at every batch size (Megatron's [s, b, ...] layout needs none;
        # these are b*s*h-sized, small beside the [s, s] traffic)
        q3, k3, v3 = (t.clone(memory_format=torch.contiguous_format).view(b * n, s, d) for t in (q, k, v))
        scores = torch.baddbmm(torch.empty(b * n, s, s, dtype=q.dtype), q3, k3.transpose(1, 2),
                               beta=0.0, alpha=d**-0.5)  # fmt: skip
        probs = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        return torch.bmm(probs, v3).view(b, n, s, d)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(self._gather(x))
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return F.dropout(self._reduce(self.fc2(y)), self.dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.family == "bert":  # post-LN
            x = self.norm1(x + self._attention(x))
            return self.norm2(x + self._mlp(x))
        x = x + self._attention(self.norm1(x))
        return x + self._mlp(self.norm2(x))


class EmbeddingHead(nn.Module):
    """Word (+ learned position) embedding, final norm, tied LM head; no layers in between
    unless ``layers`` are given. With ``tp>1`` it is a rank's vocabulary shard."""

    def __init__(self, spec: TransformerSpec, tp: int = 1, layers: int = 0) -> None:
        super().__init__()
        h = spec.hidden_size
        self.embed = nn.Embedding(padded_vocab(spec.vocab_size, tp) // tp, h)
        self.pos = None if spec.family == "llama" else nn.Embedding(spec.seq_length, h)
        self.layers = nn.ModuleList(TransformerLayer(spec, tp) for _ in range(layers))
        self.norm = RMSNorm(h) if spec.family == "llama" else nn.LayerNorm(h)
        self.head = None if spec.tied_embeddings else nn.Linear(h, self.embed.num_embeddings,
                                                                bias=False)  # fmt: skip

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(x) if self.head is not None else F.linear(x, self.embed.weight)


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of ``128 * tp``."""
    step = multiple * tp
    return int(math.ceil(vocab / step) * step)


def transformer(spec: TransformerSpec) -> nn.Module:
    """The whole (unsharded) model: what ``predict collect`` measures on one device."""
    return EmbeddingHead(spec, tp=1, layers=spec.num_layers)


def transformer_batch(spec: TransformerSpec, batch: int) -> Batch:
    tokens = torch.randint(0, spec.vocab_size, (batch, spec.seq_length))
    return Batch([tokens], torch.randint(0, spec.vocab_size, (batch, spec.seq_length)))


# ---------------------------------------------------------------------------------------------
# Vision models


@dataclass(frozen=True)
class ViTSpec:
    family: str  # "vit"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_classes: int = 100

    @property
    def seq_length(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1

    def as_transformer(self) -> TransformerSpec:
        return TransformerSpec("vit", self.num_layers, self.hidden_size,
                               self.num_attention_heads, self.seq_length, self.num_classes)  # fmt: skip


class ViT(nn.Module):
    def __init__(self, spec: ViTSpec) -> None:
        super().__init__()
        h = spec.hidden_size
        self.patch = nn.Conv2d(3, h, spec.patch_size, stride=spec.patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, h))
        self.pos = nn.Parameter(torch.zeros(1, spec.seq_length, h))
        layer_spec = spec.as_transformer()
        self.layers = nn.ModuleList(
            TransformerLayer(layer_spec, dropout=0.0) for _ in range(spec.num_layers)
        )
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, spec.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x), dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


@dataclass(frozen=True)
class ConvNetSpec:
    family: str  # "convnet"
    widths: tuple[int, ...]  # channels per stage (each stage halves the resolution)
    blocks_per_stage: int
    image_size: int
    num_classes: int = 100


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.skip(x))


class ConvNet(nn.Module):
    """ResNet-style basic-block network."""

    def __init__(self, spec: ConvNetSpec) -> None:
        super().__init__()
        w0 = spec.widths[0]
        self.stem = nn.Sequential(nn.Conv2d(3, w0, 3, 1, 1, bias=False), nn.BatchNorm2d(w0),
                                  nn.ReLU())  # fmt: skip
        blocks, cin = [], w0
        for i, w in enumerate(spec.widths):
            for j in range(spec.blocks_per_stage):
                blocks.append(_Block(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, spec.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)).mean((2, 3)))


# what the time predictor can trace: a text tower (the one spec's) or one of the CPU
# measurement zoo's ViTs and conv nets
ZooModel = TransformerSpec | ViTSpec | ConvNetSpec


def build(spec: ZooModel) -> nn.Module:
    if isinstance(spec, ViTSpec):
        return ViT(spec)
    if isinstance(spec, ConvNetSpec):
        return ConvNet(spec)
    return transformer(spec)


def make_batch(spec: ZooModel, batch: int) -> Batch:
    if isinstance(spec, ViTSpec | ConvNetSpec):
        images = torch.randn(batch, 3, spec.image_size, spec.image_size)
        return Batch([images], torch.randint(0, spec.num_classes, (batch,)))
    return transformer_batch(spec, batch)
