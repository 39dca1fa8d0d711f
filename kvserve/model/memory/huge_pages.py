"""A CPU model's weights on transparent huge pages (2 MiB), read every decode step.

Why: decode reads every weight once a step, and on 4 KiB pages a 1B model's 0.7 GB
(Q4_0) is 170,000 pages a step, each a TLB miss; under a hypervisor each miss is a
two-level page walk. A plain AVX-512 read of 1 GiB ran at 27-28 GB/s on 4 KiB pages
and 37 GB/s on huge pages (an AMD EPYC virtual machine, 2 threads). Linux gives
anonymous memory huge pages only where asked (`/sys/kernel/mm/transparent_hugepage/
enabled` is `madvise` on most distributions), and torch asks only under its
THP_MEM_ALLOC_ENABLE variable, read once at its first allocation: too early for a
library to set. So after loading, each weight tensor of at least HUGE bytes is copied
once into a fresh anonymous mapping advised MADV_HUGEPAGE before its first touch
(the kernel then faults it in 2 MiB at a time), and the module's parameter or buffer
points there. Tensors that share storage (tied embeddings) stay shared.

Memory: the old copies go back to the kernel as the move goes (the loader passes glibc's
malloc_trim, called every TRIM_EVERY bytes and at the end; the load's other freed blocks
go with them), though a tensor's last huge page is whole: the default model's resident
memory is 1,108 MB against 1,390 MB on 4 KiB pages.

Written by hand: torch has no per-tensor huge-page allocation, and the mapping is a
few lines of the standard library's `mmap`. Off with KVSERVE_HUGE_PAGES=0, where the
platform has no MADV_HUGEPAGE (not Linux), and for tensors that are views of a larger
storage (moving them would copy the rest).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

ENV = "KVSERVE_HUGE_PAGES"
"""0 leaves the weights where loading put them."""
PAGE = 2 << 20
"""A huge page on x86-64 and most arm64 kernels."""
HUGE = PAGE
"""Tensors smaller than one huge page gain nothing."""
TRIM_EVERY = 256 << 20
"""Bytes moved between two malloc_trim calls: the old copies of tensors under glibc's raised
mmap threshold (kvserve.model.cpu_malloc) are freed into its heap, and would otherwise stay
resident beside the new ones until the end of the move (twice the weights at the peak)."""


def available() -> bool:
    """Whether this process may ask for huge pages: Linux's MADV_HUGEPAGE, not turned off."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV, "1") != "0"


def huge_empty_like(tensor: torch.Tensor) -> torch.Tensor | None:
    """An uninitialised CPU tensor of `tensor`'s shape and dtype on memory advised for huge
    pages, 2 MiB aligned; None where the kernel refuses the mapping or the advice."""
    nbytes = tensor.numel() * tensor.element_size()
    size = -(-nbytes // PAGE) * PAGE + PAGE  # room to align the start
    try:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no address space left (a ulimit): the weights stay where they are
        return None
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages
        mapping.close()
        return None
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -address % PAGE
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(tensor.dtype).view(tensor.shape)  # raw keeps the mapping alive


def move_weights_to_huge_pages(
    model: nn.Module, give_back: Callable[[], object] = lambda: None
) -> int:
    """Copy each CPU parameter and buffer of at least HUGE bytes that owns its whole storage
    onto huge pages (tensors sharing one storage stay shared); the bytes moved. `give_back`
    hands freed memory back to the kernel (the loader's: kvserve.model.cpu_malloc's
    malloc_trim), called every TRIM_EVERY bytes and at the end."""
    if not available():
        return 0
    moved: dict[int, torch.Tensor] = {}  # old storage address -> its new tensor
    parameters: dict[int, nn.Parameter] = {}  # a tied parameter stays one object
    total = trimmed = 0
    for slots, name, tensor in _movable_slots(model):
        key = tensor.data_ptr()
        if key not in moved:
            fresh = huge_empty_like(tensor)
            if fresh is None:  # refused: the rest stays where it is
                break
            fresh.copy_(tensor.detach())
            moved[key] = fresh
            total += fresh.numel() * fresh.element_size()
            if total - trimmed >= TRIM_EVERY:
                give_back()
                trimmed = total
        if isinstance(tensor, nn.Parameter):
            if id(tensor) not in parameters:
                parameters[id(tensor)] = nn.Parameter(moved[key], tensor.requires_grad)
            slots[name] = parameters[id(tensor)]
        else:
            slots[name] = moved[key]
    if total:  # the old copies, freed, go back to the kernel rather than stay in the heap
        give_back()
        log.info("weights: %.0f MB on 2 MiB pages (%s=0: 4 KiB pages)", total / 1e6, ENV)
    return total


def _movable_slots(model: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """(the module's parameter or buffer dict, the name, the tensor) of each tensor to move."""
    return [
        (slots, name, tensor)
        for module in model.modules()
        for slots in (module._parameters, module._buffers)
        for name, tensor in slots.items()
        if tensor is not None and _movable(tensor)
    ]


def transparent_huge_pages() -> str:
    """The kernel's mode (`always`, `madvise`, `never`), or "not available" (not Linux)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    found = re.search(r"\[(\w+)\]", path.read_text()) if path.exists() else None
    return found.group(1) if found else "not available"


def _movable(tensor: torch.Tensor) -> bool:
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return False  # oneDNN's packed weights (torch._mkldnn) are its own
    nbytes = tensor.numel() * tensor.element_size()
    return (
        nbytes >= HUGE
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == nbytes
    )
