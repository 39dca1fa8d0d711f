"""Which weights a quantization mode packs, and the swap of their modules.

Modes (`EngineArgs.quantization`):

- none: every weight in the engine's dtype (the default; float32 with `exact`: transformers' bits);
- int8: per-output-channel symmetric int8 (`Int8Linear`);
- int4: int4 in blocks of 32 input columns, a float16 scale and offset each
  (`Int4Linear`); the lm_head gets int8 (a layer whose width the kernel
  cannot run, not a multiple of 64, stays in the engine's dtype);
- gguf: a GGUF file's own 4-bit blocks (Q4_0, Q4_1, Q4_K) kept as they are,
  repacked once for the int4 kernel (kvserve.model.quant.gguf_blocks); other types
  are dequantized as with none.

What is packed: every linear projection inside the decoder layers (attention
q/k/v/o, the MLP, a Mamba mixer's in/out projections) and the lm_head: its
own weight, or, tied to the embeddings, a packed copy of them (the logits are
the biggest matmul of a small model's decode step: SmolLM2-135M's lm_head
holds as many weights as eight of its thirty layers). The lm_head is packed at 8
bits even in int4: 4-bit logits cost SmolLM2 7 % perplexity, 8-bit ones
0.3 %. Embeddings, norms, convolutions and the attention itself stay in the
engine's dtype, and so does everything when the mode is none.

The kernel is kvserve's own (kvserve.model.cpu_kernels.quant_matmul): it reads
and writes the engine's dtype (float32 or bfloat16) and quantizes each input
row to int8 in blocks of 32. On CUDA every mode but none is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant.quant_linear import BLOCK, Int4Linear, Int8Linear, PackedLinear, fits

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "int4", "gguf")


def check_quantization(name: str, device: torch.device) -> None:
    """Refuse an unknown mode, and a packed one off the CPU, with a line that says why."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")
    if name != "none" and device.type != "cpu":
        raise ValueError(
            f"quantization {name!r} runs kvserve's CPU kernel only; on {device.type} use "
            "quantization 'none' (the model's dtype)"
        )


@dataclass(slots=True)
class QuantSummary:
    """What a mode packed, for the load log."""

    mode: str
    int8: list[str] = field(default_factory=list)
    int4: list[str] = field(default_factory=list)
    unpacked: list[str] = field(default_factory=list)
    """Layers left in the engine's dtype: shapes neither kernel runs, a GGUF's float tensors."""
    bytes: int = 0

    def describe(self) -> str:
        parts = []
        if self.int4:
            parts.append(f"{len(self.int4)} int4 (blocks of {BLOCK})")
        if self.int8:
            parts.append(f"{len(self.int8)} int8 (per channel)")
        if self.unpacked:
            parts.append(f"{len(self.unpacked)} in the engine's dtype")
        packed = ", ".join(parts) or "no"
        built, kernel = quant_matmul.enable(), quant_matmul.kernel()
        if kernel is None:
            how = f"weights dequantized per call: no kernel ({built.reason})"
        else:
            how = f"int8 activations on the {kernel.path} kernel"
            if kernel.tile_rows:
                how += f", {kernel.tile_rows} rows and more on AMX tiles in bfloat16"
        return (
            f"quantization {self.mode}: {packed} linear layers, {self.bytes / 2**20:.1f} MiB "
            f"packed, {how}"
        )


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder layers' linear projections and an untied lm_head, by qualified name."""
    layers = model.get_submodule("model.layers")
    found = {
        f"model.layers.{name}": module
        for name, module in layers.named_modules()
        if isinstance(module, nn.Linear)
    }
    if isinstance(model.lm_head, nn.Linear):
        found["lm_head"] = model.lm_head
    return found


def packing_targets(model: nn.Module) -> dict[str, tuple[str, torch.Tensor | None]]:
    """Module name -> (the parameter whose weight it packs, its bias): the linear modules,
    and for a tied lm_head the embeddings (the module is then added)."""
    targets: dict[str, tuple[str, torch.Tensor | None]] = {
        name: (f"{name}.weight", m.bias) for name, m in linear_modules(model).items()
    }
    if model.lm_head is None:
        targets["lm_head"] = ("model.embed_tokens.weight", None)
    return targets


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def swap_float_linears(
    model: nn.Module,
    dtype: torch.dtype,
    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module],
) -> int:
    """Swap every plain nn.Linear of `dtype` for make(weight, bias), and a tied lm_head for
    make(embeddings, None) (a packed copy: the lookup keeps the rows); the number swapped."""
    count = 0
    for name, module in linear_modules(model).items():
        if type(module) is nn.Linear and module.weight.dtype == dtype:
            replace_module(model, name, make(module.weight, module.bias))
            count += 1
    embeddings = model.get_parameter("model.embed_tokens.weight")
    if getattr(model, "lm_head", None) is None and embeddings.dtype == dtype:
        replace_module(model, "lm_head", make(embeddings, None))
        count += 1
    return count


def quantize_model(model: nn.Module, mode: str) -> QuantSummary:
    """Pack the weights `mode` packs (int8 or int4), in place; the float ones are dropped."""
    summary = QuantSummary(mode)
    if mode not in ("int8", "int4"):
        return summary
    for name, (weight_name, bias) in packing_targets(model).items():
        packed: PackedLinear
        weight = model.get_parameter(weight_name)
        in_features = weight.shape[1]
        as_int4 = mode == "int4" and name != "lm_head"  # int4 logits cost 7 % perplexity
        if not fits(in_features):
            summary.unpacked.append(name)
            continue
        if as_int4:
            packed = Int4Linear.quantize(weight, bias)
            summary.int4.append(name)
        else:
            packed = Int8Linear.quantize(weight, bias)
            summary.int8.append(name)
        replace_module(model, name, packed)
    return summary
