"""Attention on the CPU in C: paged decode for bfloat16 and float32 (one call a layer, no
gathered context), and a prefill's causal attention (fresh, or after a cached prefix). The
vector paths are written once on simd_f32.h's float32 vectors: AVX-512, or AVX2 with FMA at
half the width (most laptops, AMD EPYC before Zen 4); other CPUs run plain C loops.

torch's CPU attention for a decode step first gathers each row's keys and
values out of the paged cache (`index_select`) into a padded copy, then runs
SDPA's flash kernel, whose fixed cost per sequence and head dominates for one
query token; torch ships no paged kernel for the CPU. `attention.c` reads
every row's context straight from the cache through its slots, with
SDPA's arithmetic (float32 scores, softmax and sums; the probabilities rounded
to bfloat16 before they weight the values, as its flash kernel does: without
that rounding the default model's greedy tokens left float32's and vLLM's
within five tokens of a benchmark prompt), in 0.11-0.45x the time of gather +
SDPA (benchmarks/README.md, "cpu_kernels"). float32's decode keeps every product in
float32; it runs only inside a fast float32 runner's step (float32_scope): the exact
mode keeps SDPA, token for token with transformers.

A causal prefill without a window or soft-cap runs on AVX-512's bfloat16 dot
products where the CPU has them: its scores in one pass, exact row maxima, then
the weights (rounded to bfloat16, as SDPA's flash kernel rounds them) times the
values; 0.45x SDPA's time at 256 tokens, 0.56x at 1,000. A fresh prefill reads
its own new rows; one after a cached prefix reads its keys in place through the
context's slots (chat prompts, whose template's system prompt is a cache hit).
float32 has its own prefill: the same two passes with float32 FMAs in register
tiles of 4 rows x 32 keys (AVX-512) or 4 x 16 (AVX2 with FMA), nothing rounded.

`enable()` builds (or finds cached) the library once per process; until
then, and wherever it cannot be built, `kernel()` is None and the caller
keeps gather + SDPA.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from kvserve.model.cpu_kernels.build import (
    AMX_ENV,
    FLOAT,
    INT,
    INT64,
    POINTER,
    Built,
    address,
    function,
    load,
)
from kvserve.model.cpu_kernels.float32_scope import float32_on

SOURCE = Path(__file__).with_name("attention.c")

_P, _I, _L, _F = POINTER, INT, INT64, FLOAT


class AttentionKernel:
    """The loaded library's decode and prefill attention, for bfloat16 and float32."""

    def __init__(self, library: ctypes.CDLL) -> None:
        decode_args = (_I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _F, _I)
        self._decode = {
            torch.bfloat16: function(library, "decode_attention_bf16", *decode_args),
            torch.float32: function(library, "decode_attention_f32", *decode_args),
        }
        prefill_args = (_I, _P, _L, _P, _L, _P, _L, _P, _I, _P, _I, _I, _I, _I, _F, _I)
        self._prefill = {
            torch.bfloat16: function(library, "prefill_attention_bf16", *prefill_args),
            torch.float32: function(library, "prefill_attention_f32", *prefill_args),
        }
        self._tiles = function(library, "attention_tiles", _I, _I)
        self.tiles = self.use_tiles(os.environ.get(AMX_ENV, "1") != "0")
        """Whether bfloat16 prefills run on AMX tiles (prefill_attention_amx.h)."""
        probe = (None, 0, None, 0, None, 0, None, 0, None, 0, 1, 1, 64, 1.0, 1)
        self.prefill_dtypes = frozenset(t for t, fn in self._prefill.items() if fn(*probe) == 0)
        """The dtypes whose prefill this machine's build computes (bfloat16: AVX-512 with
        bfloat16 dot products; float32: AVX-512 or AVX2 with FMA); SDPA's flash kernel runs
        the others."""

    def use_tiles(self, on: bool) -> bool:
        """bfloat16 prefills on AMX tiles (where the CPU has them) or on AVX-512 BF16 (tests,
        benchmarks): the new `tiles`."""
        self.tiles = bool(self._tiles(int(on)))
        return self.tiles

    def decode_address(self, dtype: torch.dtype) -> int:
        """The C address of the decode kernel for `dtype` (decode_layers.c calls it)."""
        return address(self._decode[dtype])

    @property
    def can_prefill(self) -> bool:
        """Whether the bfloat16 prefill kernel is in this build."""
        return torch.bfloat16 in self.prefill_dtypes

    def handles(self, query: torch.Tensor, k_flat: torch.Tensor) -> bool:
        """What the kernel computes: bfloat16 (or float32 in a fast float32 step) on the CPU,
        a contiguous cache, head sizes in multiples of 16 up to 256, at most 16 query heads
        a kv head."""
        heads, dim = query.shape[1], query.shape[2]
        kv_heads = k_flat.shape[1]
        dtype = query.dtype
        return (
            (dtype == torch.bfloat16 or (dtype == torch.float32 and float32_on()))
            and query.device.type == "cpu"
            and k_flat.dtype == dtype
            and k_flat.is_contiguous()
            and dim % 16 == 0
            and dim <= 256
            and heads % kv_heads == 0
            and heads // kv_heads <= 16
        )

    def decode(
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
        status = self._decode[query.dtype](
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

    def prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether `prefill` computes this causal prefill: [T, heads, dim] queries and
        [*, kv_heads, dim] keys and values (a fresh prefill's own rows or the flat caches)
        of one dtype the build computes (float32 in a fast float32 step only) on the CPU,
        any row stride, head sizes in multiples of 64 up to 256, at most 16 query heads a
        kv head."""
        dim, dtype = q.shape[-1], q.dtype
        return (
            dtype in self.prefill_dtypes
            and (dtype == torch.bfloat16 or float32_on())
            and k.dtype == v.dtype == dtype
            and q.device.type == "cpu"
            and all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == dim for t in (q, k, v))
            and dim % 64 == 0
            and dim <= 256
            and q.shape[1] % k.shape[1] == 0
            and q.shape[1] // k.shape[1] <= 16
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Causal attention of one sequence's [T, heads, dim] new queries, written into `out`
        ([T, heads, dim], contiguous). Without `slots`: a fresh prefill over its own new keys
        and values (k, v: [T, kv_heads, dim]). With `slots` ([C] long, C >= T): the queries
        are positions C - T .. C - 1 after a cached prefix, and key j is row slots[j] of the
        flat caches k, v ([num_slots, kv_heads, dim]), every new key already written."""
        length, heads, dim = q.shape
        if not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"prefill attention writes a contiguous {tuple(q.shape)} output")
        context = length
        if slots is not None:
            slots = slots.contiguous()
            context = slots.shape[0]
        status = self._prefill[q.dtype](
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            None if slots is None else slots.data_ptr(),
            context,
            out.data_ptr(),
            length,
            heads,
            k.shape[1],
            dim,
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(
                f"prefill attention kernel refused {length} queries over {context} keys of "
                f"{heads} heads of {dim}"
            )


_kernel: AttentionKernel | None = None
_built: Built | None = None


def kernel() -> AttentionKernel | None:
    """The process's kernel once `enable()` loaded it; None otherwise."""
    return _kernel


def enable() -> Built:
    """Build or load the kernel (once per process; later calls return the first result):
    where the library is, or why there is none."""
    global _kernel, _built
    if _built is None:
        library, _built = load(SOURCE)
        _kernel = None if library is None else AttentionKernel(library)
    return _built
