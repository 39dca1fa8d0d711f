"""Compile the Triton kernels for NVIDIA GPUs on a machine without one; prints JSON.

Triton's compiler (with the ptxas its wheel ships) builds a kernel for a named target
without a GPU or a driver: a kernel that a GPU cannot compile (a tl.dot below 16 rows,
a mixed-type loop variable, a shape that is no power of two) fails here as it would on
the GPU. The constants are the launcher's own (attention_constants). Run in a process
without TRITON_INTERPRET (the interpreter replaces the kernels when it is on).

    python tests/model/attention/triton_gpu_compile.py   # from the repository root
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from kvserve.model.attention.triton_attention import attention_constants
from kvserve.model.attention.triton_kernels import (
    merge_splits_kernel,
    paged_attention_kernel,
    store_kv_kernel,
)

TARGETS = {"sm_80 (A100)": 80, "sm_90 (H100)": 90}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
POINTERS = {"Q", "k_cache", "v_cache", "Out", "K", "V"}
INDEX_POINTERS = {"query_start", "seq_starts", "block_tables", "slots"}
FLOAT_POINTERS = {"Part", "Lse"}  # a split decode's float32 partial results
FLOATS = {"scale", "softcap"}

# (name, dtype, heads, kv_heads, head_dim, softcap, window): real models' layer shapes
# and the tests' tiny ones.
SHAPES = [
    ("Qwen3-0.6B", torch.bfloat16, 16, 8, 128, None, None),
    ("SmolLM2-135M", torch.bfloat16, 9, 3, 64, None, None),
    ("Gemma 3 1B sliding", torch.bfloat16, 4, 1, 256, None, 512),
    ("soft-capped, windowed", torch.float16, 8, 4, 128, 50.0, 4096),
    ("Qwen3-0.6B float32", torch.float32, 16, 8, 128, None, None),
    ("Gemma 3 1B float32", torch.float32, 4, 1, 256, None, 512),
    ("tiny float32", torch.float32, 4, 2, 16, None, None),
    ("tiny float32 windowed, capped", torch.float32, 6, 2, 24, 20.0, 3),
]


STEPS = [("decode", True, 1), ("split decode", True, 8), ("prefill", False, 1)]
"""(name, decodes only, splits) of the kernel variants a step launches."""


def signature(kernel, dtype: torch.dtype, constants: dict) -> dict[str, str]:
    types = {}
    for name in kernel.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in POINTERS:
            types[name] = f"*{TYPES[dtype]}"
        elif name in INDEX_POINTERS:
            types[name] = "*i64"
        elif name in FLOAT_POINTERS:
            types[name] = "*fp32"
        else:
            types[name] = "fp32" if name in FLOATS else "i32"
    return types


def build(kernel, dtype: torch.dtype, constants: dict, target: int) -> tuple[str, int]:
    """The kernel's PTX for the target (raises where the GPU's compiler would), and the
    shared memory one program needs."""
    constants = dict(constants)
    options = {"num_warps": constants.pop("num_warps", 4)}
    source = ASTSource(kernel, signature(kernel, dtype, constants), constexprs=constants)
    compiled = compile(source, target=GPUTarget("cuda", target, 32), options=options)
    return compiled.asm["ptx"], compiled.metadata.shared


def compile_shape(target_name: str, shape: tuple) -> list[dict]:
    """Every kernel variant of one layer shape for one target, as result rows."""
    target = TARGETS[target_name]
    name, dtype, heads, kv_heads, dim, softcap, window = shape
    results = []
    for step, decode_only, splits in STEPS:
        constants = attention_constants(
            dtype, heads, kv_heads, dim, decode_only, softcap, window, splits
        )
        ptx, shared = build(paged_attention_kernel, dtype, constants, target)
        results.append(
            {
                "kernel": "attention",
                "target": target_name,
                "shape": name,
                "dtype": TYPES[dtype],
                "step": step,
                "shared_bytes": shared,
                "tensor_core_ops": len(re.findall(r"\b(?:wg)?mma\.", ptx)),
            }
        )
    merge = {"HEAD_DIM": dim, "HEAD_DIM_P2": constants["HEAD_DIM_P2"], "SPLITS": 8}
    _, shared = build(merge_splits_kernel, dtype, merge, target)
    results.append({"kernel": "merge_splits", "target": target_name, "shape": name,
                    "shared_bytes": shared})  # fmt: skip
    row = kv_heads * dim
    store = {"ROW": row, "ROW_P2": 1 << (row - 1).bit_length()}
    _, shared = build(store_kv_kernel, dtype, store, target)
    results.append({"kernel": "store_kv", "target": target_name, "shape": name,
                    "shared_bytes": shared})  # fmt: skip
    return results


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels")
    targets = [target for target in TARGETS for _ in SHAPES]
    shapes = [shape for _ in TARGETS for shape in SHAPES]
    # A cold compile is seconds a kernel, on one core each: use them all.
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        rows = [row for found in pool.map(compile_shape, targets, shapes) for row in found]
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
