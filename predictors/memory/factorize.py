"""Analytical per-layer memory factorization.

Each layer of each tower is factorized into parameter bytes (by dtype), gradient bytes,
optimizer-state bytes and the bytes of the tensors autograd saves for backward, as closed forms
of the shapes. The saved-tensor rules follow what the ``transformers`` implementations (Llama,
Qwen2, CLIP, SigLIP, LLaVA) keep alive under CUDA autocast rules, checked against the tracker
(tests/predictors/test_memory_factorize.py):

* non-autocast precisions save tensors in the weight dtype ``b``; under autocast matmul-class
  outputs are in the low dtype, the residual stream and norms stay fp32, every ``Linear`` keeps
  its own low-precision copy of its input and the autocast cache keeps one of its weight;
* RMSNorm (HF) saves ``rsqrt`` (fp32) and the fp32 normalized input; LayerNorm saves its output
  plus fp32 mean/rstd; the residual stream is saved once per norm input;
* FlashAttention saves q, k, v (GQA k/v at their own head count), the output and an fp32
  log-sum-exp; eager attention additionally saves the fp32 softmax ``(B, H, S, S)`` (and its
  low-precision copy);
* activation checkpointing keeps only each checkpointed layer's input, and the layer being
  recomputed re-materializes its own saved tensors in the backward;
* a frozen tower with nothing trainable upstream saves nothing; a frozen tower downstream of a
  trainable one (or upstream of nothing) saves only what the input gradient needs;
* LoRA (PEFT's ``lora.Linear``: ``base(x) + B(A(dropout(x))) * scaling``) freezes the text
  tower's own weights and adds a trainable ``A``/``B`` pair per targeted Linear (a layer entry
  of its own right after its decoder layer, so ZeRO shards and Adam states see its tensors);
  each adapted Linear saves the dropout's mask and output (what ``A`` needs for its weight
  gradient) and ``A``'s output (what ``B`` needs); the frozen base saves only what the input
  gradient needs, which every decoder layer propagates down to the first adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..spec.model import LoraSpec, ModelSpec, TransformerSpec, VisionTowerSpec
from ..spec.precision import Precision
from .config import Shapes, Step, resolve_shapes

F32 = 4


def _bytes(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


@dataclass
class LayerMemory:
    """One layer's factorized bytes (per GPU, before ZeRO sharding)."""

    name: str
    tower: str
    params: int  # number of parameters
    param_bytes: int
    trainable: bool
    saved: int = 0  # activation bytes saved for backward
    largest: int = 0  # largest single activation tensor (transient scale in backward)
    tensors: int = 0  # parameter tensors
    tensor_params: tuple[int, ...] = ()  # elements of each parameter tensor
    tensor_bytes: tuple[int, ...] = ()  # bytes of each, where not elements x the dtype's width
    saved_tensors: tuple[int, ...] = ()  # bytes of each saved tensor, when known (sum = saved)


@dataclass
class Factorization:
    layers: list[LayerMemory] = field(default_factory=list)
    loss_saved: int = 0  # logits (+ fp32 log-softmax) kept for the cross-entropy backward
    loss_transient: int = 0  # extra live bytes while the loss and its gradient are computed
    held_output: int = 0  # logits the model output keeps alive until the step ends
    input_bytes: int = 0
    num_param_tensors: int = 0
    num_trainable_tensors: int = 0

    def total(self, attr: str, tower: str | None = None) -> int:
        return sum(getattr(x, attr) for x in self.layers if tower in (None, x.tower))


@dataclass(frozen=True)
class _Dt:
    """Byte widths for a precision: weights, matmul outputs, residual stream, autocast flag."""

    w: int
    mm: int
    res: int
    autocast: bool

    @classmethod
    def of(cls, p: Precision) -> _Dt:
        w = _bytes(p.param_dtype)
        mm = _bytes(p.compute_dtype) if p.autocast else w
        return cls(w, mm, w, p.autocast)


# -- parameter tensors (element counts, in the module's registration order) ----------------------
def vision_layer_params(v: VisionTowerSpec) -> tuple[int, ...]:
    h, f = v.hidden_size, v.ffn_hidden_size
    attn = (h * h, h) * 4  # q, k, v, out projections with biases
    return attn + (h, h) + (h * f, f, f * h, h) + (h, h)  # LN1, MLP, LN2


def vision_embed_params(v: VisionTowerSpec) -> tuple[int, ...]:
    h, p = v.hidden_size, v.patch_size
    n = v.num_patches()
    if v.has_cls:  # CLIP: class token, bias-free patch conv, position table, pre-LN
        return (h, 3 * p * p * h, (n + 1) * h, h, h)
    return (3 * p * p * h, h, n * h)


def vision_post_params(v: VisionTowerSpec) -> tuple[int, ...]:
    h, f = v.hidden_size, v.ffn_hidden_size
    if v.has_cls:
        return (h, h)
    # SigLIP post-LN + attention-pooling head (probe, MHA, LN, MLP)
    return (h, h, h, 3 * h * h, 3 * h, h * h, h, h, h, h * f, f, f * h, h)


def text_linears(t: TransformerSpec) -> dict[str, tuple[int, int]]:
    """``(d_in, d_out)`` of a Llama/Qwen2 decoder layer's Linears by PEFT's name for them, in
    the layer's registration order."""
    h, f = t.hidden_size, t.ffn
    kv = t.kv_heads * (h // t.num_attention_heads)
    return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def _text_layer_tensors(t: TransformerSpec) -> list[tuple[int, bool]]:
    """A decoder layer's parameter tensors in order: (elements, whether a Linear weight)."""
    out = []
    for name, (d_in, d_out) in text_linears(t).items():
        out.append((d_in * d_out, True))
        if t.family == "qwen2" and name in ("q_proj", "k_proj", "v_proj"):
            out.append((d_out, False))  # Qwen2's q/k/v projections carry biases
    return out + [(t.hidden_size, False)] * 2  # the two RMSNorms


def text_layer_params(t: TransformerSpec) -> tuple[int, ...]:
    return tuple(n for n, _ in _text_layer_tensors(t))


def lora_shapes(t: TransformerSpec, lora: LoraSpec) -> list[tuple[int, int]]:
    """``(d_in, d_out)`` of each Linear of one decoder layer that ``lora`` adapts, in the
    layer's registration order."""
    return [dims for name, dims in text_linears(t).items() if name in lora.targets]


def lora_params(t: TransformerSpec, lora: LoraSpec) -> tuple[int, ...]:
    """One decoder layer's adapter tensors: ``A`` (rank x d_in) and ``B`` (d_out x rank) per
    adapted Linear (PEFT's ``lora_A`` / ``lora_B``, bias-free)."""
    return tuple(n for d_in, d_out in lora_shapes(t, lora)
                 for n in (lora.rank * d_in, d_out * lora.rank))


def text_layer_weights(t: TransformerSpec) -> tuple[bool, ...]:
    """Which of :func:`text_layer_params`' tensors are Linear weights (not biases or norms)."""
    return tuple(w for _, w in _text_layer_tensors(t))


NF4_BLOCK = 64  # bitsandbytes' 4-bit blocksize: one absmax per 64 weights
NF4_NESTED_BLOCK = 256  # double quantization: the 8-bit absmax get an fp32 absmax per 256


def nf4_bytes(n: int) -> int:
    """Device bytes of an ``n``-element weight in bitsandbytes' nf4 with double quantization
    (``quantize_4bit(..., quant_type="nf4", compress_statistics=True)``, what ``Linear4bit``
    and LLaVA's ``--bits 4 --double_quant True`` store): packed 4-bit weights, an 8-bit absmax
    per block, an fp32 absmax per nested block, the nested 8-bit code (256 fp32), the nf4 code
    (16 fp32) and the fp32 offset."""
    blocks = -(-n // NF4_BLOCK)
    return -(-n // 2) + blocks + 4 * -(-blocks // NF4_NESTED_BLOCK) + 4 * (256 + 16 + 1)


def projector_params(spec: ModelSpec) -> tuple[int, ...]:
    vh, th = spec.vision.hidden_size, spec.text.hidden_size
    if spec.projector == "linear":
        return (vh * th, th)
    return (vh * th, th, th * th, th)


# -- saved activations ----------------------------------------------------------------------------
def linear_saved(tokens: int, d_in: int, d_out: int, bias: bool, dt: _Dt, *,
                 input_grad: bool, weight_trainable: bool, input_low: bool) -> int:
    """Saved bytes of one Linear beyond its (already counted) input tensor.

    Under autocast the Linear saves a low-precision copy of an fp32 input (when its weight
    needs a gradient) and its cached low-precision weight (when its input needs a gradient)."""
    if not dt.autocast:
        return 0
    out = 0
    if weight_trainable and not input_low:
        out += tokens * d_in * dt.mm
    if input_grad:
        out += (d_in * d_out + (d_out if bias else 0)) * dt.mm
    return out


def rmsnorm_saved(tokens: int, h: int, dt: _Dt) -> int:
    """HF RMSNorm computes in fp32: rsqrt and the fp32 normalized input are saved."""
    if dt.res == F32:
        return tokens * F32 + tokens * h * F32
    # low-precision input: fp32 upcast, rsqrt, and the down-cast normalized input
    return tokens * h * F32 + tokens * F32 + tokens * h * dt.res


def layernorm_saved(tokens: int, h: int, dt: _Dt) -> int:
    """Output (saved by the consumer when it is not an autocast Linear) + fp32 mean/rstd."""
    return 2 * tokens * F32


def flash_saved(batch: int, heads: int, seq: int, q: int, kv: int, tokens: int, b: int
                ) -> list[int]:
    """q, k, v, the output and the fp32 log-sum-exp."""
    return [tokens * q * b, tokens * kv * b, tokens * kv * b, tokens * q * b,
            batch * heads * seq * F32]


def eager_scores_saved(batch: int, heads: int, seq: int, b: int) -> list[int]:
    """fp32 softmax probabilities (+ their low-precision cast)."""
    scores = batch * heads * seq * seq
    return [scores * F32] + ([scores * b] if b != F32 else [])


def llama_layer_saved(t: TransformerSpec, batch: int, seq: int, dt: _Dt, attention: str,
                      trainable: bool, lora: LoraSpec | None = None) -> tuple[list[int], int]:
    """Tensors (bytes; several small saves of one op may be lumped) a Llama/Qwen2 decoder layer
    saves, and its largest single saved tensor."""
    n = batch * seq
    h, f, heads = t.hidden_size, t.ffn, t.num_attention_heads
    kv = t.kv_heads * (h // heads)
    bias = t.family == "qwen2"
    lin = dict(input_grad=True, weight_trainable=trainable)
    # two RMSNorms; their output is saved once for the Linears that need it for weight grads
    norm_out = n * h * dt.res if trainable and not dt.autocast else 0
    norm = rmsnorm_saved(n, h, dt)
    if lora is not None and lora.dropout and not trainable:
        # LoRA's frozen norm weights need no normalized input, and the adapters read their
        # dropout's output instead of the norm's
        norm -= n * h * dt.res
    parts = [norm, norm_out] * 2
    if dt.res == F32:  # residual adds feed the norms directly (else their fp32 upcast is saved)
        parts += [n * h * dt.res] * 2
    parts.append(linear_saved(n, h, h, bias, dt, input_low=False, **lin))
    parts += [linear_saved(n, h, kv, bias, dt, input_low=False, **lin)] * 2
    parts.append(linear_saved(n, h, h, False, dt, input_low=True, **lin))  # o_proj: input low
    if attention == "flash":
        parts += flash_saved(batch, heads, seq, h, kv, n, dt.mm)
    else:  # q and repeated k/v made contiguous for bmm, output copy for o_proj, scores
        parts += [n * h * dt.mm] * 4 + eager_scores_saved(batch, heads, seq, dt.mm)
    # gate, silu, up (, gate*up for down's weight gradient, or for its adapter's A without
    # dropout)
    down_in = trainable or (lora is not None and not lora.dropout and "down_proj" in lora.targets)
    parts += [n * f * dt.mm] * (4 if down_in else 3)
    parts += [linear_saved(n, h, f, False, dt, input_low=False, **lin)] * 2
    parts.append(linear_saved(n, f, h, False, dt, input_low=True, **lin))
    largest = max(n * f * dt.mm, batch * heads * seq * seq * F32 if attention == "unfused" else 0)
    return [x for x in parts if x], largest


def lora_saved(t: TransformerSpec, lora: LoraSpec, tokens: int, dt: _Dt) -> list[int]:
    """Tensors one decoder layer's adapters save: per adapted Linear the dropout's bool mask
    and output (``A``'s input; without dropout ``A`` shares the input the base Linear got),
    ``A``'s output (``B``'s input), and under autocast their cast weights and input copies."""
    r, parts = lora.rank, []
    if dt.autocast and not lora.dropout:
        # A casts its fp32 input, a norm's output, to a low-precision copy it saves: one per
        # norm whose Linears it adapts (the traced step shares it between q/k/v, gate/up)
        h = t.hidden_size
        groups = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})
        parts += [tokens * h * dt.mm for g in groups if g & set(lora.targets)]
    for d_in, d_out in lora_shapes(t, lora):
        if lora.dropout:
            parts += [tokens * d_in, tokens * d_in * dt.mm]
        parts.append(tokens * r * dt.mm)
        lin = dict(input_grad=True, weight_trainable=True, input_low=True)
        parts += [linear_saved(tokens, d_in, r, False, dt, **lin),
                  linear_saved(tokens, r, d_out, False, dt, **lin)]
    return [x for x in parts if x]


def vit_layer_saved(v: VisionTowerSpec, images: int, tokens: int, dt: _Dt, attention: str,
                    trainable: bool) -> tuple[list[int], int]:
    """Tensors a CLIP/SigLIP encoder layer saves (``tokens`` per image), and the largest."""
    n = images * tokens
    h, f, heads = v.hidden_size, v.ffn_hidden_size, v.num_attention_heads
    lin = dict(input_grad=True, weight_trainable=trainable)
    parts = [layernorm_saved(n, h, dt), 0 if dt.autocast else n * h * dt.res] * 2
    parts += [n * h * dt.res] * 2  # the two residual adds
    parts += [linear_saved(n, h, h, True, dt, input_low=False, **lin)] * 3
    parts.append(linear_saved(n, h, h, True, dt, input_low=True, **lin))
    if attention == "flash":
        parts += flash_saved(images, heads, tokens, h, h, n, dt.mm)
    else:
        parts += [n * h * dt.mm] * 4 + eager_scores_saved(images, heads, tokens, dt.mm)
    parts += [n * f * dt.mm] * (3 if v.family == "clip" else 2)  # quick_gelu vs tanh-gelu
    parts.append(linear_saved(n, h, f, True, dt, input_low=False, **lin))
    parts.append(linear_saved(n, f, h, True, dt, input_low=True, **lin))
    largest = max(n * f * dt.mm, images * heads * tokens * tokens * F32 if attention == "unfused" else 0)
    return [x for x in parts if x], largest


def _vit_weight_cache(v: VisionTowerSpec, dt: _Dt) -> int:
    """Low-precision weight copies autocast caches for one encoder layer's (or SigLIP head's)
    Linears: 4 attention projections + 2 MLP matrices with biases."""
    h, f = v.hidden_size, v.ffn_hidden_size
    return (4 * h * h + 2 * h * f + 5 * h + f) * dt.mm


# -- whole model ------------------------------------------------------------------------------------
def factorize(spec: ModelSpec, cfg: Step) -> Factorization:
    """Per-layer factorization of ``spec`` trained under ``cfg`` (one GPU, before sharding)."""
    shapes: Shapes = resolve_shapes(spec, cfg)
    p = cfg.precision
    dt = _Dt.of(p)
    # LoRA freezes the text tower's own weights; its adapters are separate layer entries
    frozen = set(spec.frozen) | ({"llm"} if spec.lora is not None else set())
    fz = Factorization()
    wbytes = dt.w

    def add(name, tower, sizes, saved=0, largest=0, trainable=None, parts=(), nbytes=()):
        n, tensors = sum(sizes), len(sizes)
        tr = tower not in frozen if trainable is None else trainable
        parts = tuple(parts) if sum(parts) == saved else ()  # adjusted totals: shapes unknown
        fz.layers.append(LayerMemory(name, tower, n, sum(nbytes) or n * wbytes, tr, saved,
                                     largest, tensors, tuple(sizes), tensor_bytes=tuple(nbytes),
                                     saved_tensors=parts))
        fz.num_param_tensors += tensors
        fz.num_trainable_tensors += tensors if tr else 0

    grad_flows = False  # does anything upstream of the current point need a gradient?
    v, t = spec.vision, spec.text
    # a pipeline stage after the first holds none of what feeds the text tower's embedding
    # (the vision tower and projector sit upstream, on the first stage), but still passes a
    # gradient back to them where they train
    front = t is None or t.holds_embedding
    if spec.multimodal and not front:
        grad_flows = not {"vision", "projector"} <= frozen
    if v is not None and front:
        train_v = "vision" not in frozen
        images = shapes.images if spec.multimodal else cfg.batch
        tok = shapes.vision_tokens
        used = v.num_layers - 1 if spec.multimodal else v.num_layers  # LLaVA reads layer -2
        parts, largest = vit_layer_saved(v, images, tok, dt, spec.attention, train_v)
        per = sum(parts)
        if not train_v:
            parts, per, largest = [], 0, 0
        nv = images * tok
        emb = nv * v.hidden_size * dt.res  # embeddings output
        if v.has_cls:  # pre-LN: fp32 mean/rstd, and its output unless Linears copy it
            emb += layernorm_saved(nv, v.hidden_size, dt) + (0 if dt.autocast else emb)
        if dt.autocast:  # patch conv keeps low-precision copies of pixels and kernel
            emb += images * 3 * v.image_size ** 2 * dt.mm + 3 * v.patch_size ** 2 * v.hidden_size * dt.mm
        add("vision.embeddings", "vision", vision_embed_params(v), saved=emb if train_v else 0)
        for i in range(v.num_layers):
            saved = per if i < used else 0
            if i >= used and dt.autocast and train_v:  # the autocast cache holds weight casts
                saved = _vit_weight_cache(v, dt)
            layer_parts = list(parts) if i < used else []
            hidden_out = images * tok * v.hidden_size * dt.res
            if i == used - 1 and spec.multimodal and saved:  # its output only feeds the slice
                saved -= hidden_out
                if hidden_out in layer_parts:
                    layer_parts.remove(hidden_out)
            if cfg.checkpointing == "full" and train_v and i < used:
                saved = hidden_out
            # layers after the feature layer (and the post-LN/head) get no gradient, so AdamW
            # keeps no state for them
            reached = train_v and i < used
            add(f"vision.layers.{i}", "vision", vision_layer_params(v), saved, largest,
                trainable=reached, parts=layer_parts)
        # SigLIP's pooling head runs (unused) inside LLaVA; autocast caches its weight casts
        post = _vit_weight_cache(v, dt) if (
            spec.multimodal and dt.autocast and train_v and not v.has_cls) else 0
        add("vision.post", "vision", vision_post_params(v), saved=post,
            trainable=train_v and not spec.multimodal)
        grad_flows = train_v
        fz.input_bytes += images * 3 * v.image_size ** 2 * wbytes
    if spec.multimodal and front:
        train_p = "projector" not in frozen
        n = shapes.images * shapes.patches
        saved = 0
        if train_p or grad_flows:
            th = t.hidden_size
            saved = (0 if dt.autocast else n * v.hidden_size * dt.res) + 2 * n * th * dt.mm + (
                linear_saved(n, v.hidden_size, th, True, dt, input_grad=grad_flows,
                             weight_trainable=train_p, input_low=False)
                + linear_saved(n, th, th, True, dt, input_grad=True, weight_trainable=train_p,
                               input_low=True))
        add("projector", "projector", projector_params(spec), saved)
        grad_flows = grad_flows or train_p
    if t is not None:
        train_t = "llm" not in frozen
        n = cfg.batch * t.seq_length
        needs = train_t or grad_flows or spec.lora is not None
        parts, largest = llama_layer_saved(t, cfg.batch, t.seq_length, dt, spec.attention, train_t,
                                           spec.lora)
        if spec.lora is not None:
            parts += lora_saved(t, spec.lora, n, dt)
        per = sum(parts)
        if not needs:
            parts, per, largest = [], 0, 0
        emb = (n * t.hidden_size * dt.res if dt.res == F32 else 0) + 2 * t.seq_length * (t.hidden_size // t.num_attention_heads) * dt.res
        if spec.multimodal:  # concatenated image features + placeholder mask
            emb += shapes.images * shapes.patches * t.hidden_size * dt.mm + n
        if t.holds_embedding:
            add("llm.embed", "llm", (t.vocab_size * t.hidden_size,), saved=emb if needs else 0)
        qbytes: tuple[int, ...] = ()
        qlargest = largest
        if spec.lora is not None and spec.lora.base_bits == 4:
            # QLoRA: the Linear weights in nf4; each is dequantized to the compute dtype around
            # its matmul (forward and backward), a transient of the largest one
            qbytes = tuple(nf4_bytes(k) if w else k * wbytes for k, w in zip(
                text_layer_params(t), text_layer_weights(t), strict=True))
            qlargest = max(largest, t.hidden_size * t.ffn * dt.mm)
        for i in range(t.num_layers):
            saved = per
            if cfg.checkpointing == "full" and needs:
                saved = n * t.hidden_size * dt.res
            add(f"llm.layers.{i}", "llm", text_layer_params(t), saved, qlargest, parts=parts,
                nbytes=qbytes)
            if spec.lora is not None:
                add(f"llm.layers.{i}.lora", "lora", lora_params(t, spec.lora), trainable=True)
        if t.holds_head:
            tied = t.tied_embeddings and not spec.multimodal  # LLaVA unties (its own config flag)
            # a tied head shares the embedding's weight only on the stage that holds both;
            # Megatron's last stage keeps its own copy (``setup_embeddings_and_output_layer``)
            head = () if tied and t.holds_embedding else (t.vocab_size * t.hidden_size,)
            add("llm.head", "llm", (t.hidden_size, *head),
                saved=(rmsnorm_saved(n, t.hidden_size, dt)
                       + (0 if dt.autocast or dt.res != F32 else n * t.hidden_size * dt.res)
                       + linear_saved(n, t.hidden_size, t.vocab_size, False, dt, input_grad=True,
                                      weight_trainable=train_t, input_low=False)) if needs else 0)
            logits = n * t.vocab_size
            fz.held_output = logits * dt.mm
            if needs:
                fz.loss_saved = logits * (dt.mm + F32)  # logits (held by the output) + log-softmax
                fz.loss_transient = logits * F32 * 2  # fp32 upcast, then d(log-softmax)
            else:
                fz.loss_saved = logits * dt.mm
        fz.input_bytes += n * 8 * 2
    else:
        h = v.hidden_size
        add("head", "head", (h * spec.num_classes, spec.num_classes),
            saved=cfg.batch * h * dt.res * 3)
        fz.loss_saved = cfg.batch * spec.num_classes * (dt.mm + F32)
        fz.loss_transient = cfg.batch * spec.num_classes * F32 * 2
    return fz
