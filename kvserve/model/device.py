"""Which torch device (and dtype) the engine runs on, checked before anything is loaded.

torch's own errors for a device it cannot use are a parser message listing twenty
device types ("tpu"), or an assertion deep in its CUDA initialisation ("cuda" on a
CPU-only build): neither says what to pass instead. kvserve runs on the CPU and on
CUDA, so those are the names it accepts, and a CUDA device must exist here.
"""

from __future__ import annotations

import torch

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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" is float32 on CPU (exact, and fast enough there) and bfloat16 on CUDA."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}") from None
