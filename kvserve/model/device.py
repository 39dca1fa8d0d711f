"""Which torch device (and dtype) the engine runs on, checked before anything is loaded.

On the CPU the dtype depends on the CPU too (issue 43): without native bfloat16 (AVX-512
BF16 or AMX) bfloat16 is emulated and float32 runs about 2.5x faster, so "auto" never
picks bfloat16 there, an explicit bfloat16 warns, and the start-up line says which.

torch's own errors for a device it cannot use are a parser message listing twenty
device types ("tpu"), or an assertion deep in its CUDA initialisation ("cuda" on a
CPU-only build): neither says what to pass instead. kvserve runs on the CPU and on
CUDA, so those are the names it accepts, and a CUDA device must exist here.
"""

from __future__ import annotations

import torch

from kvserve.model.cpu_kernels.cpu_features import CpuFeatures

SUPPORTED = "'cpu', 'cuda' or 'cuda:N'"


def resolve_device(name: str) -> torch.device:
    """`name` as a torch device (the runner's default, when none is named, is CUDA when
    available, else the CPU).

    A ValueError names the device when it is not one kvserve runs on, or when this
    machine has no such CUDA device.
    """
    if not isinstance(name, str):
        raise ValueError(f"device must be a string ({SUPPORTED}), got {name!r}")
    try:
        device = torch.device(name.strip())
    except RuntimeError:
        raise ValueError(f"device {name!r} is not supported: use {SUPPORTED}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {name!r} is not supported: use {SUPPORTED}")
    if not torch.cuda.is_available():
        why = (
            f"this torch build ({torch.__version__}) has no CUDA support"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        raise ValueError(f"device {name!r} is not available: {why}; use 'cpu'")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"device {name!r} is not available: this machine has {count} CUDA device(s)"
        )
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_FLOAT16_WARNING = (
    "dtype float16 on the CPU decodes far slower than float32 or bfloat16 (the CPU has "
    "few float16 kernels): use bfloat16 for half the memory of float32"
)


def cpu_float16_warning(cpu: CpuFeatures) -> str:
    """float16's warning: bfloat16 is the advice only where this CPU runs it natively."""
    if cpu.native_bf16:
        return CPU_FLOAT16_WARNING
    return (
        "dtype float16 on the CPU decodes far slower than float32 (the CPU has few float16 "
        f"kernels, and this one no native bfloat16 either: {cpu.describe()}): use float32"
    )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" is float32 on the CPU and bfloat16 on CUDA (float16 where it has none).

    float32 on every CPU: on a CPU without native bfloat16 (cpu_dtype_reason) the fastest,
    where bfloat16 is emulated through float32; its matmuls are oneDNN's packed ones unless
    the engine is exact (kvserve.model.quant.onednn_linear).
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}") from None


PACKED_DTYPE_WHY = (
    "packed layers read and write that dtype, their matmuls int8 activations times the "
    "packed codes (VNNI or AVX2: no native bfloat16 needed)"
)
"""What `quantization` does to the matmuls whatever the dtype (docs/quantization.md)."""


def cpu_bfloat16_warning(cpu: CpuFeatures) -> str:
    """The warning for an explicit bfloat16 on a CPU that emulates it; "" where it is native."""
    if cpu.native_bf16:
        return ""
    return (
        f"dtype bfloat16 on a CPU without native bfloat16 ({cpu.describe()}) is emulated "
        "through float32 and runs slower: --dtype float32 (dtype='float32') is about 2.5x "
        "faster on such CPUs"
    )


def cpu_dtype_warning(dtype: torch.dtype, cpu: CpuFeatures) -> str:
    """The one warning an engine of `dtype` on this CPU gets (float16; bfloat16 without
    native bfloat16), or ""."""
    if dtype == torch.float16:
        return cpu_float16_warning(cpu)
    return cpu_bfloat16_warning(cpu) if dtype == torch.bfloat16 else ""


def cpu_dtype_reason(
    name: str,
    dtype: torch.dtype,
    cpu: CpuFeatures,
    quantization: str,
    exact: bool = False,
    panels: bool = False,
) -> str:
    """The start-up line's words on the CPU: the CPU, its features, the dtype and why, and
    whether the float matmuls are the fast ones (`panels`: kvserve's kernels,
    kvserve.model.quant.panel_linear; else float32's packed for oneDNN) or the exact ones."""
    chosen = str(dtype).removeprefix("torch.")
    if name != "auto":
        why = "as asked"
        if dtype == torch.bfloat16 and not cpu.native_bf16:
            why += "; float32 is about 2.5x faster here"
    elif cpu.native_bf16:
        why = "auto; --dtype bfloat16 runs faster on this CPU"
    else:
        why = "auto: the fastest without native bfloat16"
    fast = "(--exact: transformers' bits)"
    if panels:
        kind = "AVX-512 BF16" if dtype == torch.bfloat16 else "float32"
        why += f"; matmuls on kvserve's {kind} kernel {fast}"
    elif dtype == torch.float32 and quantization == "none":
        why += "; exact: transformers' matmuls" if exact else f"; matmuls packed for oneDNN {fast}"
    packed = f"; {PACKED_DTYPE_WHY}" if quantization != "none" else ""
    return f"CPU: {cpu.describe()}; dtype {chosen} ({why}){packed}"
