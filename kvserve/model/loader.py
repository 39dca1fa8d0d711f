"""Load a checkpoint into a decoder: a Hugging Face directory or a GGUF file.

Only safetensors weights are read from a directory (a pickle file runs code
when loaded); a GGUF file is read with gguf-py (kvserve.model.checkpoint.gguf_weights).
Either way the model is built on the meta device, every checkpoint name and
shape is checked against it before any tensor is read, and the tensors are
then assigned directly in the target dtype and device: no random init, no
second copy. The projections that read one input are then stacked into one
layer each (kvserve.model.quant.fusion), quantization packs what it packs, and
float linear layers on the CPU get their weights packed once: outside the exact mode
in panels for kvserve's kernels (kvserve.model.quant.panel_linear: float32 on AVX2 or
AVX-512, bfloat16 on AVX-512 BF16), else for oneDNN (kvserve.model.quant.onednn_linear;
float32 in the exact mode stays F.linear's).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from gguf import GGUFReader, ReaderTensor
from safetensors import safe_open

from kvserve.model.checkpoint.config import (
    ModelConfig,
    architecture_of,
    read_hf_config_files,
    read_json,
)
from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.checkpoint.gguf_config import gguf_config_dicts
from kvserve.model.checkpoint.gguf_file import open_gguf
from kvserve.model.checkpoint.gguf_weights import gguf_state_dict, locate_tensors
from kvserve.model.checkpoint.resolve import resolve_checkpoint
from kvserve.model.checkpoint.weight_check import check_weights
from kvserve.model.cpu_malloc import give_back_freed_memory
from kvserve.model.memory.huge_pages import move_weights_to_huge_pages
from kvserve.model.models import DecoderForCausalLM, model_class
from kvserve.model.quant.fusion import fuse_projections
from kvserve.model.quant.gguf_blocks import gguf_packed_layers
from kvserve.model.quant.onednn_linear import onednn_available, pack_linears
from kvserve.model.quant.panel_linear import panels_available, use_panels
from kvserve.model.quant.quant_linear import Int4Linear, packed_bytes
from kvserve.model.quant.quantize import (
    QuantSummary,
    check_quantization,
    linear_modules,
    quantize_model,
    replace_module,
)

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Names some checkpoints carry that hold nothing we load (recomputed buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    exact: bool = False,
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Build the checkpoint's model with its weights; raise ModelLoadError when we cannot.

    `model_dir`: a Hugging Face checkpoint directory, a .gguf file, or a
    directory holding one (kvserve.model.checkpoint.resolve). `quantization`: one of
    kvserve.model.quant.quantize.QUANTIZATIONS; int8 and int4 pack the loaded
    weights, gguf keeps a GGUF file's 4-bit blocks (CPU only). `exact`: float32 and
    bfloat16 matmuls stay F.linear's, transformers' bits (kvserve.model.quant.onednn_linear).
    """
    check_quantization(quantization, device)
    checkpoint = resolve_checkpoint(model_dir)
    if quantization == "gguf" and checkpoint.gguf is None:
        raise ModelLoadError(
            f"quantization 'gguf' keeps a GGUF file's own blocks, and {model_dir} is a "
            "Hugging Face checkpoint: use int8 or int4"
        )
    reader = None
    if checkpoint.gguf is not None:
        reader = open_gguf(checkpoint.gguf)  # parsed once, for the config and the weights
        raw, generation = gguf_config_dicts(reader)
    else:
        raw, generation = read_hf_config_files(checkpoint.directory)
    cls = model_class(architecture_of(raw))
    config = ModelConfig.from_dict(raw, generation)
    with torch.device("meta"):
        model = cls(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    summary = QuantSummary(quantization)
    if reader is not None:
        located = locate_tensors(reader, expected)
        if quantization == "gguf":
            summary = install_gguf_layers(model, reader, located, config)
        state = gguf_state_dict(reader, located, config, dtype, device)
    else:
        state = _safetensors_state_dict(checkpoint.directory, expected, config, dtype, device)
    model.load_state_dict(state, strict=True, assign=True)
    del state  # the model holds each tensor now: one the packing replaces is freed with it
    fuse_projections(model)  # q/k/v and gate/up as one matmul each, before any packing
    if quantization in ("int8", "int4"):
        summary = quantize_model(model, quantization)
    if quantization != "none":
        summary.bytes = packed_bytes(model)
        logger.info(summary.describe())
    if panels_available(dtype, device, exact):  # every matmul on kvserve's kernel
        use_panels(model, dtype)
    elif onednn_available(dtype, device, exact):  # no per-call weight reorder (onednn_linear)
        pack_linears(model, dtype)
    model.requires_grad_(False)
    if device.type == "cpu":  # decode reads every weight a step: no TLB miss every 4 KiB
        move_weights_to_huge_pages(model, give_back_freed_memory)
    model.eval()
    model.init_rotary(device)
    return model, config


def install_gguf_layers(
    model: DecoderForCausalLM,
    reader: GGUFReader,
    located: dict[str, ReaderTensor],
    config: ModelConfig,
) -> QuantSummary:
    """Quantization 'gguf': swap in the packed layers (the model is still on the meta
    device) and drop their weights from `located`, so they are never dequantized."""
    summary = QuantSummary("gguf")
    packed = gguf_packed_layers(reader, located, model, config)
    for name in linear_modules(model):
        if name not in packed:
            summary.unpacked.append(name)
    for name, module in packed.items():
        replace_module(model, name, module)
        located.pop(f"{name}.weight", None)  # a tied lm_head's embeddings stay
        (summary.int4 if isinstance(module, Int4Linear) else summary.int8).append(name)
    return summary


def _safetensors_state_dict(
    model_dir: Path,
    expected: dict[str, tuple[int, ...]],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    located = _locate(weight_files(model_dir), expected, config.tie_word_embeddings)
    state: dict[str, torch.Tensor] = {}
    for path, names in _by_file(located).items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return state


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: sharded (index), single, or any *.safetensors."""
    path = Path(model_dir)
    index = path / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no 'weight_map'")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"shards listed in {INDEX_FILE} are missing: {missing}")
        return files
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = " (pickle *.bin weights are not loaded)" if any(path.glob("*.bin")) else ""
        raise ModelLoadError(f"no *.safetensors weights in {path}{extra}")
    return files


def _locate(files: list[Path], expected: dict[str, tuple[int, ...]], tied: bool) -> dict[str, Path]:
    """Map every expected name to its file, checking names and shapes first."""
    located: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    unexpected: list[str] = []
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights file {path}: {exc}") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                shapes[name] = tuple(f.get_slice(name).get_shape())
                located[name] = path
    check_weights(expected, shapes, unexpected)
    return located


def _by_file(located: dict[str, Path]) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for name, path in located.items():
        grouped.setdefault(path, []).append(name)
    return grouped
