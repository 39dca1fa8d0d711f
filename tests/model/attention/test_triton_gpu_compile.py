"""The Triton kernels compile for A100 and H100 GPUs, checked on a machine without one,
and fit the shared memory of every NVIDIA GPU since Ampere.

The CPU tests run the kernels in Triton's interpreter, which does not enforce what a
GPU's compiler does; this builds each kernel variant the launcher asks for (its own
attention_constants) down to PTX and a cubin for sm_80 and sm_90, in a subprocess
without the interpreter (tests/model/attention/triton_gpu_compile.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.compiler")

SCRIPT = Path(__file__).with_name("triton_gpu_compile.py")
ROOT = Path(__file__).parents[3]


def test_every_kernel_variant_compiles_for_a100_and_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    attention = [r for r in rows if r["kernel"] == "attention"]
    shapes = len({r["shape"] for r in rows})
    assert len(attention) == 2 * shapes * 3  # targets x shapes x (decode, split, prefill)
    others = sorted(r["kernel"] for r in rows if r["kernel"] != "attention")
    assert others == ["merge_splits"] * 2 * shapes + ["store_kv"] * 2 * shapes
    for row in rows:  # sm_86 and sm_89 GPUs give a kernel at most 99 KiB of shared memory
        assert row["shared_bytes"] <= 99 * 1024, row
    for row in attention:
        if row["dtype"] == "fp32":  # exact float32: no TF32 tensor-core products
            assert row["tensor_core_ops"] == 0, row
        else:  # half precision products run on tensor cores
            assert row["tensor_core_ops"] > 0, row
