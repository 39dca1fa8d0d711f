"""vLLM as it runs on an AVX2-only CPU, on a CPU with AVX-512 (benchmarks/cpu_vs_vllm.py).

vLLM's CPU build picks its own kernels by what torch's cpuinfo says the hardware has
(`torch.cpu._is_avx512_supported()` and its kin): its `_C_AVX2` library or the AVX-512
ones, and its attention's instruction set. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA cap
torch's and oneDNN's own code, not that choice. cpu_vs_vllm.py puts this folder on the
PYTHONPATH of vLLM's processes when the run is capped at AVX2 (KVSERVE_CPU_FEATURES
without avx512), and Python imports this module at start-up, before vLLM: it answers
False for every AVX-512 and AMX query, so vLLM loads and runs its AVX2 kernels, as on an
AVX2-only CPU. It changes nothing else, and nothing at all in any other process.
"""

import os

if os.environ.get("KVSERVE_BENCH_PEER_AVX2") == "1":
    import torch.cpu

    for query in (
        "_is_avx512_supported",
        "_is_avx512_vnni_supported",
        "_is_avx512_bf16_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        if hasattr(torch.cpu, query):
            setattr(torch.cpu, query, lambda: False)
