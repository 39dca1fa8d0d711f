"""A decode step's decoder layers as one C call (kvserve.model.cpu_kernels.decode_layers).

Why: with 4-bit weights on the CPU, a decode step of a 1B model spends about a fifth
of its time in the Python between its kernels (modules, torch's small ops, ctypes),
and llama.cpp-like speed needs that gone. The call runs the very kernels the Python
path runs, in its order, so a step's numbers are the same bits either way (the tests
compare the two paths' logits bit for bit).

It is planned once per model by the CPU runner, and only where every layer is the plain
pre-norm decoder (DecoderLayer, DecoderAttention without q/k norms or soft-capping,
GatedMLP with SiLU, RMSNorm) with packed projections (kvserve.model.quant: int4, int8,
gguf) or float ones on kvserve's kernels (panel_linear), and a full rotary
embedding; without LoRA adapters. A step takes it only where the Python path would run
those same kernels: every row a decode in batch order (the attention metadata's
`whole_batch`, with the C kernel's bounds), fewer rows than the packed layers' threshold
(DENSE_ROWS; panel layers have none), bfloat16 or a fast float32 step, caches of
the rows' dtype. Any other step runs the modules.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.cpu_kernels import attention, decode_layers
from kvserve.model.cpu_kernels.decode_layers import DecodeLayers, Layer, Packed, Reads, Step
from kvserve.model.cpu_kernels.float32_scope import float32_on
from kvserve.model.layers.common import GatedMLP, RMSNorm
from kvserve.model.quant.panel_linear import PanelLinear
from kvserve.model.quant.quant_linear import DENSE_ROWS, PackedLinear

if TYPE_CHECKING:
    from kvserve.lora.slots import LoRASlots
    from kvserve.model.cpu_kernels.switch import CpuKernels
    from kvserve.model.models.decoder import DecoderForCausalLM


def plan_fused_decode(
    model: DecoderForCausalLM, dtype: torch.dtype, kernels: CpuKernels, lora: LoRASlots | None
) -> str:
    """Give a CPU runner's model its fused decode where its kernels run (bfloat16, or a
    fast float32) and no LoRA adapter wraps its layers; the words its load log adds."""
    if lora is not None or not (dtype == torch.bfloat16 or kernels.float32):
        return ""
    model.fused_decode = FusedDecode.for_model(model)
    return ", a decode step's layers in one call" if model.fused_decode else ""


def _packed(linear: PackedLinear | PanelLinear, dtype: torch.dtype) -> Packed | None:
    """The projection's C arguments, or None where the call cannot take its tensors."""
    if isinstance(linear, PanelLinear):  # quant_matmul's bits 16 or 32: weights in panels
        panels, bias = linear.panels, linear.bias
        if dtype != panels.dtype or not panels.is_contiguous() or panels.device.type != "cpu":
            return None
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            return None
        ptr = None if bias is None else bias.data_ptr()
        shape = (linear.out_features, linear.in_features)
        bits = 16 if dtype == torch.bfloat16 else 32
        return Packed(panels.data_ptr(), None, None, ptr, *shape, bits, 0)
    tensors = [linear.codes, linear.scales, linear.offsets, linear.bias]
    if not all(t is None or (t.is_contiguous() and t.device.type == "cpu") for t in tensors):
        return None
    if linear.bias is not None and linear.bias.dtype != dtype:
        return None
    return Packed(
        linear.codes.data_ptr(),
        linear.scales.data_ptr(),
        None if linear.offsets is None else linear.offsets.data_ptr(),
        None if linear.bias is None else linear.bias.data_ptr(),
        linear.out_features,
        linear.in_features,
        linear.bits,
        int(linear.scales.dtype == torch.float16),
    )


class FusedDecode:
    """A model's layers as one `decode_layers` call per decode step."""

    def __init__(
        self,
        library: DecodeLayers,
        layers: ctypes.Array[Layer],
        shapes: tuple[int, int, int, int, int],
        dtype: torch.dtype,
        eps: float,
        scale: float,
        max_rows: int,
    ) -> None:
        self.library = library
        self.max_rows = max_rows
        """Steps of fewer rows take the call: the layers' own threshold."""
        self.layers = layers
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate = shapes
        self.dtype = dtype
        self.eps = eps
        self.scale = scale
        self.steps = 0
        """Decode steps run by the call (the tests and benchmarks read it)."""
        self._query = torch.empty(1, self.heads, self.head_dim, dtype=dtype)
        """A query's shape, for the attention kernel's own check."""

    @classmethod
    def for_model(cls, model: DecoderForCausalLM) -> FusedDecode | None:
        """The model's plan, or None where a layer is not the plain decoder with packed
        projections (or the C library cannot be built)."""
        from kvserve.model.models.decoder import DecoderAttention, DecoderLayer, DecoderModel

        config = model.config
        if type(model.model) is not DecoderModel or type(model.model.norm) is not RMSNorm:
            return None
        dtype = model.model.norm.weight.dtype
        if config.rotary_dim != config.head_dim or dtype not in (torch.bfloat16, torch.float32):
            return None
        structs, eps, scale, limits = [], set(), set(), set()
        for layer in model.model.layers:
            if type(layer) is not DecoderLayer:
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn) is not DecoderAttention or type(mlp) is not GatedMLP:
                return None
            if attn.q_norm is not None or attn.softcap is not None:
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(n) is not RMSNorm or n.weight.dtype != dtype for n in norms):
                return None
            modules = [getattr(attn, "qkv_proj", None), attn.o_proj]
            modules += [getattr(mlp, "gate_up_proj", None), mlp.down_proj]
            linears = [p for p in modules if isinstance(p, PackedLinear | PanelLinear)]
            limits |= {DENSE_ROWS[dtype] for p in linears if isinstance(p, PackedLinear)}
            packed = [s for s in (_packed(p, dtype) for p in linears) if s is not None]
            if len(packed) != len(modules):
                return None
            norm_in, norm_post = norms
            structs.append(Layer(*packed, norm_in.weight.data_ptr(), norm_post.weight.data_ptr()))
            eps |= {norm_in.eps, norm_post.eps}
            scale.add(attn.scale)
        if not structs or len(eps) != 1 or len(scale) != 1:
            return None
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        intermediate = config.intermediate_size
        shapes = (config.hidden_size, heads, kv_heads, head_dim, intermediate)
        widths = [
            (structs[0].qkv, (heads + 2 * kv_heads) * head_dim, config.hidden_size),
            (structs[0].o, config.hidden_size, heads * head_dim),
            (structs[0].gate_up, 2 * intermediate, config.hidden_size),
            (structs[0].down, config.hidden_size, intermediate),
        ]
        if any((p.out_features, p.in_features) != (n, k) for p, n, k in widths):
            return None
        decode_layers.enable()
        library = decode_layers.kernel()
        if library is None or library.kernels(dtype) is None:
            return None
        array = (Layer * len(structs))(*structs)
        rows = min(limits, default=sys.maxsize)  # PanelLinear: its kernel at any rows
        return cls(library, array, shapes, dtype, eps.pop(), scale.pop(), rows)

    def run(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: Sequence[AttentionMetadata],
    ) -> bool:
        """Run every layer on x in place and return True, or return False (nothing done)
        where the Python path would run other kernels this step."""
        dtype, rows = x.dtype, x.shape[0]
        if dtype != self.dtype or x.device.type != "cpu" or not x.is_contiguous():
            return False
        if (dtype == torch.float32 and not float32_on()) or not 0 < rows < self.max_rows:
            return False
        kernels, paged = self.library.kernels(dtype), attention.kernel()
        if kernels is None or paged is None or len(kv_caches) != len(self.layers):
            return False
        cos, sin = cos_sin
        if cos.shape != (rows, 1, self.head_dim) or cos.dtype != dtype or sin.shape != cos.shape:
            return False
        cos, sin = cos.contiguous(), sin.contiguous()
        kept: list[torch.Tensor] = [cos, sin]  # alive until the call returns
        reads_of: dict[int, Reads] = {}
        reads = (ctypes.c_void_p * len(metas))()
        for i, meta in enumerate(metas):
            found = reads_of.get(id(meta))
            if found is None:
                found = self._reads(meta, rows, kept)
                if found is None:
                    return False
                reads_of[id(meta)] = found
            reads[i] = ctypes.addressof(found)
        caches = (ctypes.c_void_p * (2 * len(kv_caches)))()
        for i, (k, v) in enumerate(kv_caches):
            if k.dtype != dtype or v.dtype != dtype or v.shape != k.shape:
                return False
            if not (k.is_contiguous() and v.is_contiguous()):
                return False
            if k.shape[-2:] != (self.kv_heads, self.head_dim):
                return False
            caches[2 * i], caches[2 * i + 1] = k.data_ptr(), v.data_ptr()
        if not paged.handles(self._query, kv_caches[0][0].flatten(0, 1)):
            return False
        step = Step(
            rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
            int(dtype == torch.bfloat16), torch.get_num_threads(), cos.data_ptr(),
            sin.data_ptr(), self.eps, self.scale,
        )  # fmt: skip
        self.library(kernels, step, self.layers, caches, reads, x)
        self.steps += 1
        return True

    @staticmethod
    def _reads(meta: object, rows: int, kept: list[torch.Tensor]) -> Reads | None:
        """A group's write and read slots, where every row is a decode in batch order."""
        if type(meta) is not AttentionMetadata or meta.write_index is not None:
            return None
        group = meta.whole_batch
        if group is None or group.bounds is None or meta.write_slots.shape != (rows,):
            return None
        write = meta.write_slots.contiguous()
        slots, bounds = group.slots.contiguous(), group.bounds.contiguous()
        if write.dtype != torch.int64 or slots.dtype != torch.int64 or bounds.dtype != torch.int32:
            return None
        if slots.shape[0] != rows or bounds.shape != (rows, 2):
            return None
        kept += [write, slots, bounds]
        return Reads(write.data_ptr(), slots.data_ptr(), bounds.data_ptr(), slots.shape[1])
