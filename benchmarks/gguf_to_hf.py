"""The default model's GGUF as a Hugging Face directory, for engines that read only those.

Run: .venv/bin/python benchmarks/gguf_to_hf.py [--out DIR] [--model FILE.gguf]

vLLM's CPU build reads the GGUF file's Q4_1 blocks poorly (or not at all), so
the comparison in cpu_vs_vllm.py runs both engines on one directory written
here once: kvserve's own GGUF reader dequantizes every tensor to float32
(the same values kvserve computes with when it runs the file itself, q/k rows
back in transformers' order), saved as safetensors with the config and
generation config that kvserve derives from the metadata, and the tokenizer
(with its chat template) that transformers builds from the file. Each engine
then casts to the dtype it is asked for. The directory is written under a
temporary name and renamed, so a crash leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_OUT = Path.home() / ".cache" / "kvserve" / "smollm2-135m-instruct-hf"
DONE = "model.safetensors"


def write_hf_directory(gguf_path: Path, out: Path) -> Path:
    """`out` holding config.json, generation_config.json, model.safetensors and the
    tokenizer files; an existing complete directory is kept as it is."""
    if (out / DONE).exists():
        return out
    import torch
    from safetensors.torch import save_file

    from kvserve.model.checkpoint.config import load_model_config
    from kvserve.model.checkpoint.gguf_config import TOKENIZER_MODEL_FIELD, gguf_config_dicts
    from kvserve.model.checkpoint.gguf_file import open_gguf
    from kvserve.model.checkpoint.gguf_weights import (
        gguf_state_dict,
        locate_tensors,
        model_name,
        tensor_shape,
    )
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    reader = open_gguf(gguf_path)
    raw, generation = gguf_config_dicts(reader)
    raw.pop(TOKENIZER_MODEL_FIELD, None)
    raw.update(model_type="llama", hidden_act="silu", torch_dtype="float32")
    config = load_model_config(gguf_path)
    expected = {}
    for tensor in reader.tensors:
        name = model_name(tensor.name)
        if name is not None:
            expected[name] = tensor_shape(tensor)
    located = locate_tensors(reader, expected)
    state = gguf_state_dict(reader, located, config, torch.float32, torch.device("cpu"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        tokenizer = load_tokenizer(gguf_path, config)
        tokenizer.save_pretrained(str(tmp))
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / DONE))
        if out.exists():  # an incomplete earlier attempt
            shutil.rmtree(out)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--model", type=Path, help="a GGUF file (default: kvserve's default model)")
    args = parser.parse_args()
    if args.model is None:
        from kvserve.default_model import default_model_path

        args.model = default_model_path()
    print(write_hf_directory(args.model, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
