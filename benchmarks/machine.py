"""The machine a benchmark ran on, for every script's header line.

Why each header names the CPU and its flags: bfloat16 runs about 10x slower on an
AVX2-only CPU than on one with AVX-512 BF16 or AMX (issue 43), so a table without them
cannot be compared with another; the load average says how busy the shared cores were.
The flags come from kvserve's own reading (kvserve/model/cpu_kernels/cpu_features.py,
which imports no torch), so a header says what the engine's start-up line says.
"""

from __future__ import annotations

import os

from kvserve.model.cpu_kernels.cpu_features import detect


def cpu() -> str:
    """ "Intel(R) Xeon(R) ... (avx2 avx512f avx512_bf16 amx ...: native bfloat16)"."""
    return detect().describe()


def load() -> str:
    """The load average over 1, 5 and 15 minutes ("?" where the system has none)."""
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


ISA_CAPS = (
    "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
    "KVSERVE_CPU_FEATURES", "KVSERVE_KERNEL_CFLAGS",
)  # fmt: skip
"""Variables that make torch, oneDNN, MKL and kvserve's C kernels run older instruction sets
than the CPU has, and kvserve choose as on another CPU (e.g. all at AVX2 on an AVX-512
CPU): a header says so, since its figures are then an emulation of another CPU's."""


def isa_caps() -> str:
    """ "ISA capped: ATEN_CPU_CAPABILITY=avx2 ..." where any is set, else ""."""
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    return "ISA capped: " + " ".join(caps) if caps else ""


def machine_line(threads: int | None = None) -> str:
    """CPU and flags, CPUs (those this process may use, where fewer), the threads a run
    uses where it has one count (a script whose rows differ says so in its rows) and the
    load average, as one phrase."""
    cpus = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    parts = [cpu(), f"{cpus} cpus" + (f" ({usable} usable)" if usable != cpus else "")]
    if threads is not None:
        parts.append(f"{threads} thread(s)")
    parts.append(f"load {load()}")
    if caps := isa_caps():
        parts.append(caps)
    return ", ".join(parts)
