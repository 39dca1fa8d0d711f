"""Writing tiny GGUF files the way llama.cpp's converter does, and the oracles that read them.

`write_gguf` turns a transformers model into a GGUF file with gguf-py's
writer: llama.cpp's tensor names (from gguf-py's own name map), its q/k row
permutation for Llama, Llama 3 rope scaling as a `rope_freqs` tensor, 1-D
tensors in F32 and 2-D ones in the requested type. It returns what a correct
reader must end up with: the dequantized tensors, under transformers' names,
with the rows put back by this file's own inverse (argsort of the forward
permutation), which shares no code with kvserve's.

gguf-py quantizes the legacy types in numpy but not the K-quants: for those,
random well-formed blocks are written (random bytes with sane fp16 scales)
and their dequantized values become the reference weights.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

K_QUANT_SCALES = {
    # type: ((byte offset, value) of each fp16 scale in a block)
    T.Q2_K: ((80, 0.01), (82, 0.01)),
    T.Q3_K: ((108, 0.002),),
    T.Q4_K: ((0, 0.0005), (2, 0.004)),
    T.Q5_K: ((0, 0.00025), (2, 0.004)),
    T.Q6_K: ((208, 0.00005),),
}
"""Scales that keep random blocks' values within about +-0.5, like the other weights."""
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp converts Mistral checkpoints as llama files
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}

TypeChoice = T | Callable[[str], T]
"""One type for every 2-D tensor, or a function of the GGUF tensor name."""


def converter_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (n_head already the kv count for k)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's converter: the per-frequency divisors of Llama 3.1 rope scaling."""
    base = rope["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def encode(array: np.ndarray, qtype: T, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, what it decodes to) for a float32 array in `qtype`."""
    if qtype in K_QUANT_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (array.size // block, size), dtype=np.uint8)
        for offset, scale in K_QUANT_SCALES[qtype]:
            value = np.float16(scale) * rng.uniform(0.5, 1.5, len(blocks)).astype(np.float16)
            blocks[:, offset : offset + 2] = value.view(np.uint8).reshape(-1, 2)
        stored = blocks.reshape(*array.shape[:-1], -1)
    else:
        stored = gguf.quants.quantize(array, qtype)
    decoded = gguf.quants.dequantize(stored, qtype).reshape(array.shape).astype(np.float32)
    return stored, decoded


def write_gguf(
    model: Any,
    path: Path,
    types: TypeChoice,
    *,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    arch: str | None = None,
    seed: int = 0,
    **writer_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Write `model` as a GGUF file; return the reference state dict (dequantized, unpermuted).

    `extra` adds metadata or tensors (a tokenizer, a broken field); `arch`
    overrides the architecture written; `writer_kwargs` go to GGUFWriter
    (`split_max_tensors` writes a sharded model).
    """
    config = model.config
    family = GGUF_ARCH[config.model_type]
    arch = arch or family
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = dict(config.rope_parameters)
    rope = dict(rope.get("full_attention", rope))  # Gemma 3: the global layers' rope
    writer = gguf.GGUFWriter(str(path), arch, **writer_kwargs)
    writer.add_name(config.model_type)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    family_metadata(writer, config, rope)
    if extra is not None:
        extra(writer)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == family)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    reference: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        array = tensor.float().numpy()
        rows = np.arange(array.shape[0])
        if family == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # the converter stores Gemma's 1 + weight
        if family == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            n = heads if ".q_proj." in hf_name else kv_heads
            array, rows = converter_permute(array, n), converter_permute(rows, n)
        qtype = types(name) if callable(types) else types
        if array.ndim == 1 or qtype in (T.F32, T.F64):
            dtype = np.float64 if qtype == T.F64 else np.float32
            stored, decoded = array.astype(dtype), array.astype(np.float32)
        else:
            stored, decoded = encode(array, qtype, rng)
        writer.add_tensor(name, stored, raw_dtype=None if stored.dtype.kind == "f" else qtype)
        if family == "gemma3" and hf_name.endswith("norm.weight"):
            decoded = decoded - np.float32(1.0)
        restored = np.empty_like(decoded)
        restored[rows] = decoded  # file row r holds the model's row rows[r]
        reference[hf_name] = torch.from_numpy(restored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def family_metadata(writer: gguf.GGUFWriter, config: Any, rope: dict[str, Any]) -> None:
    """What llama.cpp's converter writes for Mistral, Gemma 3 and Phi-3 beyond the shared
    keys: windows, Gemma's final soft-cap, Phi-3's original context and longrope factors
    (tensors, with the attention factor the converter derives)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("mistral", "gemma3_text", "phi3") and window:
        writer.add_sliding_window(window)
    if config.model_type == "gemma3_text" and config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == "phi3":
        original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original))
            )
            for key in ("long", "short"):
                factors = np.array(rope[f"{key}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{key}.weight", factors)


def reference_model(model: Any, state: dict[str, torch.Tensor]) -> Any:
    """A copy of `model` holding the reference weights."""
    return load_weights(copy.deepcopy(model), state)


def load_weights(model: Any, state: dict[str, torch.Tensor]) -> Any:
    """`model` with `state` loaded; only a tied head (it follows the embedding) may be missing."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    """transformers' `generate(do_sample=False)`: the oracle's tokens."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def transformers_gguf_model(path: Path) -> Any:
    """transformers' own GGUF loader (config mapping, names, dequantization, q/k rows), float32.

    `from_pretrained(folder, gguf_file=...)` does the same but demands
    `accelerate` in transformers 5, which kvserve does not depend on: its two
    halves are called here directly (the config reader, then the legacy
    `load_gguf_checkpoint` that dequantizes with gguf-py).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return load_weights(model, tensors)


def tokenizer_metadata(
    tokenizer_json: Path, eos: str, eot: str, chat_template: str
) -> Callable[[gguf.GGUFWriter], None]:
    """A byte-level BPE tokenizer (tokenizer.json) as llama.cpp's "gpt2" tokenizer metadata."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    merges = [m if isinstance(m, str) else " ".join(m) for m in _bpe_merges(tokenizer_json)]

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types(
            [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
        )
        writer.add_eos_token_id(vocab[eos])
        writer.add_eot_token_id(vocab[eot])
        writer.add_add_bos_token(False)
        writer.add_chat_template(chat_template)

    return write


def _bpe_merges(tokenizer_json: Path) -> list[Any]:
    import json

    return json.loads(tokenizer_json.read_text())["model"]["merges"]
