"""A GGUF file's metadata as the config dicts a Hugging Face checkpoint would carry.

The result is what `ModelConfig.from_dict` takes (config.json and
generation_config.json), so a GGUF model is checked and described by the
very code that reads Hugging Face checkpoints: one ModelConfig, one set of
rules, one set of error messages. What GGUF keeps outside its metadata is
derived from the tensors: tied embeddings (no output.weight), Llama's
optional biases, the vocabulary size (the embedding's rows), Llama 3 rope
scaling (rope_freqs, see kvserve.model.checkpoint.gguf_rope). Each family's own
fields (windows, Gemma's and Phi-3's settings) come from
kvserve.model.checkpoint.gguf_families.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.checkpoint.gguf_families import family_fields
from kvserve.model.checkpoint.gguf_file import array_length, field
from kvserve.model.checkpoint.gguf_moe import gguf_moe_fields
from kvserve.model.checkpoint.gguf_rope import rope_scaling

STOP_TOKEN_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")
"""llama.cpp ends generation at any of these (end of sequence, of turn, of message)."""
ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
"""GGUF's `general.architecture` -> the Hugging Face architecture kvserve runs it as (a llama
file with a sliding window runs as Mistral: kvserve.model.checkpoint.gguf_families)."""
TOKENIZER_MODEL_KEY = "tokenizer.ggml.model"
"""Present (gpt2, llama, ...) when the file carries a tokenizer."""
TOKENIZER_MODEL_FIELD = "gguf_tokenizer_model"
"""Where the raw config keeps it, so the runner's tokenizer needs no second parse."""


def gguf_config_dicts(reader: GGUFReader) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) equivalents of the file's metadata."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    def required(key: str) -> int:
        value = _uniform(meta(key), f"{arch}.{key}")
        if not isinstance(value, int) or value <= 0:
            raise ModelLoadError(
                f"GGUF metadata needs a positive integer {arch}.{key}, got {value!r}"
            )
        return value

    hidden = required("embedding_length")
    heads = required("attention.head_count")
    kv_heads = _uniform(meta("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv")
    head_dim = meta("attention.key_length") or hidden // heads
    value_dim = meta("attention.value_length") or head_dim
    if value_dim != head_dim:
        raise ModelLoadError(
            f"attention.key_length {head_dim} != attention.value_length {value_dim}: not supported"
        )
    theta = float(meta("rope.freq_base", 10000.0))
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": _vocab_size(reader, tensors),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        TOKENIZER_MODEL_FIELD: field(reader, TOKENIZER_MODEL_KEY),
    }
    raw.update(gguf_moe_fields(arch, meta, tensors, raw["num_hidden_layers"]))  # experts
    scaling = rope_scaling(reader, arch, theta, head_dim)
    if scaling is not None:
        raw["rope_scaling"] = scaling
    raw.update(family_fields(arch, meta, tensors, raw))
    stops = [field(reader, f"tokenizer.ggml.{key}") for key in STOP_TOKEN_KEYS]
    generation = {"eos_token_id": sorted({t for t in stops if t is not None})}
    return raw, generation


def _uniform(value: Any, key: str) -> Any:
    """Per-layer arrays (as some GGUF files write head counts) must hold one value."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ModelLoadError(f"{key} differs between layers ({value}): not supported")
        return value[0]
    return value


def _vocab_size(reader: GGUFReader, tensors: dict[str, Any]) -> int:
    """Rows of the token embedding (what the weights need); else the token list's length."""
    embedding = tensors.get("token_embd.weight")
    if embedding is not None and len(embedding.shape) == 2:
        return int(embedding.shape[1])  # GGUF lists dims innermost first: (hidden, vocab)
    count = array_length(reader, "tokenizer.ggml.tokens")
    if not count:
        raise ModelLoadError("GGUF file has neither token_embd.weight nor a token list")
    return count
