"""A 1B-parameter Llama-shaped checkpoint with random weights, for llama_1b.py.

Run: .venv/bin/python benchmarks/llama_1b_weights.py [--out DIR]

Why random weights: speed on the CPU depends on the shapes and the bytes read per token,
not on what the weights say, and a real 1B checkpoint would have to come from a model hub
(nothing here fetches one). The shapes are Llama 3.2 1B's (hidden 2,048, 16 layers, MLP
8,192, 32 query and 8 key/value heads of 64) with the default model's tokenizer (49,152
tokens, tied embeddings): 1.07B parameters.

Written once, under DIR (default ~/.cache/kvserve/llama-1b-random), each under a temporary
name and renamed, so a crash leaves nothing half-written:
- `hf/`: config, bfloat16 safetensors and the default model's tokenizer and chat template
  (from gguf_to_hf.py's directory), loaded by kvserve and vLLM;
- `model-q4_0.gguf`: the same tensors in llama.cpp's layout (its converter's q/k row
  permutation, its tensor names), every matrix in Q4_0 (gguf-py's own quantizer), norms in
  float32, the tokenizer's metadata copied from the default model's GGUF: loaded by
  llama.cpp and by kvserve (`quantization="gguf"` keeps the Q4_0 blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

OUT = Path.home() / ".cache" / "kvserve" / "llama-1b-random"
HIDDEN, LAYERS, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 16, 8192, 32, 8, 64, 49152
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": MLP,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
GGUF_NAME = "model-q4_0.gguf"


def random_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers' names -> bfloat16 tensors (std 0.02, norms 1)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN)}
    kv = KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = normal(kv, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = normal(kv, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        out[p + "mlp.gate_proj.weight"] = normal(MLP, HIDDEN)
        out[p + "mlp.up_proj.weight"] = normal(MLP, HIDDEN)
        out[p + "mlp.down_proj.weight"] = normal(HIDDEN, MLP)
        out[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        out[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    out["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return out


def write_hf(tensors: dict[str, torch.Tensor], out: Path, tokenizer_dir: Path) -> None:
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, tmp / name)
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (tmp / "generation_config.json").write_text(json.dumps(gen))
    tmp.rename(out)


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders q and k rows (rotary halves interleaved)."""
    halves = w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1])
    return halves.swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    module = rest.removesuffix(".weight")
    return f"blk.{layer}.{GGUF_NAMES[module]}.weight"


def write_gguf(tensors: dict[str, torch.Tensor], out: Path, tokenizer_gguf: Path) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T

    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("llama-1b-random")
    writer.add_context_length(CONFIG["max_position_embeddings"])
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(CONFIG["rope_theta"])
    writer.add_layer_norm_rms_eps(CONFIG["rms_norm_eps"])
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, kind)
    for name, tensor in tensors.items():
        w = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            w = converter_permute(w, HEADS)
        elif name.endswith("k_proj.weight"):
            w = converter_permute(w, KV_HEADS)
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w.astype(np.float32))
        else:
            q = gguf.quants.quantize(w, T.Q4_0)
            writer.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=T.Q4_0)
        print(f"  {gguf_name(name)}", file=sys.stderr, end="\r", flush=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    print(file=sys.stderr)


def parameters() -> int:
    """The checkpoint's parameter count (the tied embedding counted once)."""
    attention = 2 * HIDDEN * HEADS * HEAD_DIM + 2 * HIDDEN * KV_HEADS * HEAD_DIM
    layer = attention + 3 * HIDDEN * MLP + 2 * HIDDEN
    return VOCAB * HIDDEN + LAYERS * layer + HIDDEN


def ensure(out: Path = OUT) -> tuple[Path, Path]:
    """(the HF directory, the Q4_0 GGUF file), written where missing."""
    from gguf_to_hf import DEFAULT_OUT, write_hf_directory

    from kvserve.default_model import default_model_path

    hf, gguf_file = out / "hf", out / GGUF_NAME
    if hf.is_dir() and gguf_file.is_file():
        return hf, gguf_file
    tokenizer_dir = write_hf_directory(default_model_path(), DEFAULT_OUT)
    print(f"writing a random 1B Llama to {out} (a few minutes, once)", file=sys.stderr)
    tensors = random_tensors()
    if not hf.is_dir():
        write_hf(tensors, hf, tokenizer_dir)
    if not gguf_file.is_file():
        write_gguf(tensors, gguf_file, default_model_path())
    return hf, gguf_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    hf, gguf_file = ensure(args.out)
    print(f"{hf}\n{gguf_file}\n{parameters() / 1e9:.2f}B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
