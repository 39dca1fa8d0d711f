"""Paged decode attention for bfloat16 on the CPU: one C call a layer, no gathered context.

torch's CPU attention for a decode step first gathers each row's keys and
values out of the paged cache (`index_select`) into a padded copy, then runs
SDPA's flash kernel, whose fixed cost per sequence and head dominates for one
query token; torch ships no paged kernel for the CPU. `decode_attention.c`
reads every row's context straight from the cache through its slots, with
SDPA's arithmetic (float32 scores, softmax and sums; the probabilities rounded
to bfloat16 before they weight the values, as its flash kernel does: without
that rounding the default model's greedy tokens left float32's and vLLM's
within five tokens of a benchmark prompt), and is 2.5-4x faster than gather +
SDPA (benchmarks/README.md, "Paged decode attention"). float32 keeps SDPA: it
is the engine's exact mode, token for token with transformers.

`enable()` builds (or finds cached) the library once per process; until
then, and wherever it cannot be built, `kernel()` is None and the caller
keeps gather + SDPA.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvserve.model.cpu_kernels.build import Built, load

SOURCE = Path(__file__).with_name("decode_attention.c")

_P = ctypes.c_void_p
_I = ctypes.c_int
_F = ctypes.c_float


class DecodeAttentionKernel:
    """The loaded library's `decode_attention_bf16`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.decode_attention_bf16
        fn.restype = _I
        fn.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _F, _I]
        self._fn = fn

    def handles(self, query: torch.Tensor, k_flat: torch.Tensor) -> bool:
        """What the kernel computes: bfloat16 on the CPU, a contiguous cache, head sizes in
        multiples of 16 up to 256, at most 16 query heads a kv head."""
        heads, dim = query.shape[1], query.shape[2]
        kv_heads = k_flat.shape[1]
        return (
            query.dtype == torch.bfloat16
            and query.device.type == "cpu"
            and k_flat.dtype == torch.bfloat16
            and k_flat.is_contiguous()
            and dim % 16 == 0
            and dim <= 256
            and heads % kv_heads == 0
            and heads // kv_heads <= 16
        )

    def __call__(
        self,
        query: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        slots: torch.Tensor,
        bounds: torch.Tensor,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """[B, heads, dim] attention of each row's query over keys slots[b, begin:end]
        of the flat caches ([slots, kv_heads, dim]); `bounds` is [B, 2] int32."""
        query = query.contiguous()
        batch, heads, dim = query.shape
        out = torch.empty_like(query)
        slots = slots.contiguous()
        status = self._fn(
            query.data_ptr(),
            k_flat.data_ptr(),
            v_flat.contiguous().data_ptr(),
            slots.data_ptr(),
            bounds.contiguous().data_ptr(),
            out.data_ptr(),
            batch,
            heads,
            k_flat.shape[1],
            dim,
            slots.shape[1],
            scale,
            0.0 if softcap is None else softcap,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(
                f"decode attention kernel refused {batch} rows of {heads} heads of {dim} "
                f"over {k_flat.shape[1]} kv heads"
            )
        return out


_kernel: DecodeAttentionKernel | None = None
_built: Built | None = None


def kernel() -> DecodeAttentionKernel | None:
    """The process's kernel once `enable()` loaded it; None otherwise."""
    return _kernel


def enable() -> Built:
    """Build or load the kernel (once per process; later calls return the first result):
    where the library is, or why there is none."""
    global _kernel, _built
    if _built is None:
        library, _built = load(SOURCE)
        _kernel = None if library is None else DecodeAttentionKernel(library)
    return _built
