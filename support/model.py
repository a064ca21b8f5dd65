"""A local Llama model for the tests and benchmarks: config, byte-level tokenizer and seeded
random O(1) weights, all written locally (nothing is downloaded).

vLLM's ``load_format="dummy"`` draws weights in +-1e-3: attention is then uniform over a long
prefix and the output does not depend on its KV at all, so a run could not tell right KV from
wrong KV. Sharp attention (large q/k) makes the output depend on the prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

VOCAB = 512


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int
    intermediate: int
    max_len: int = 4096  # max_position_embeddings and the tokenizer's model_max_length
    rope_theta: float | None = None  # None: Llama's default

    @property
    def hidden(self) -> int:
        return self.q_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# The tests' model: 2 layers x 2 KV heads x head 32, hidden 128.
TINY = ModelShape(layers=2, kv_heads=2, head_dim=32, q_heads=4, intermediate=256)


def write_llama(directory: Path, shape: ModelShape, seed: int = 1234) -> Path:
    """Config, tokenizer and weights of a ``shape`` Llama in ``directory``; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_attention_heads": shape.q_heads,
        "num_key_value_heads": shape.kv_heads, "num_hidden_layers": shape.layers,
        "head_dim": shape.head_dim, "vocab_size": VOCAB, "max_position_embeddings": shape.max_len,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    }  # fmt: skip
    if shape.rope_theta is not None:
        config["rope_theta"] = shape.rope_theta
    (directory / "config.json").write_text(json.dumps(config))
    _write_byte_tokenizer(directory, shape.max_len)
    _write_random_weights(directory, shape, seed)
    return directory


def write_tiny_llama(directory: Path, num_layers: int = TINY.layers) -> Path:
    return write_llama(directory, replace(TINY, layers=num_layers))


def _write_random_weights(directory: Path, shape: ModelShape, seed: int = 1234) -> None:
    """Seeded random O(1) weights as a local safetensors file."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, kvd, qd = shape.hidden, shape.kv_heads * shape.head_dim, shape.q_heads * shape.head_dim

    def rand(*dims: int, scale: float = 1.5) -> torch.Tensor:
        return torch.randn(dims, generator=gen) * (scale / dims[-1] ** 0.5)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, h, scale=h**0.5),
               "model.norm.weight": torch.ones(h), "lm_head.weight": rand(VOCAB, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(qd, h, scale=4.0),
            p + "self_attn.k_proj.weight": rand(kvd, h, scale=4.0),
            p + "self_attn.v_proj.weight": rand(kvd, h),
            p + "self_attn.o_proj.weight": rand(h, qd),
            p + "mlp.gate_proj.weight": rand(shape.intermediate, h),
            p + "mlp.up_proj.weight": rand(shape.intermediate, h),
            p + "mlp.down_proj.weight": rand(h, shape.intermediate),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        })  # fmt: skip
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))


def _write_byte_tokenizer(directory: Path, max_len: int) -> None:
    """A real (byte-level) tokenizer built locally with ``tokenizers``: no hub access needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": max_len}))  # fmt: skip
