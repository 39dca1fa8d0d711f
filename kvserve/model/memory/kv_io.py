"""Bytes in and out of the paged K/V tensors: what the external tiers store.

A hash block of an attention group is its K and V rows in every tensor the
group's layers use; a state snapshot is the whole page (conv and SSM state
sit in its K and V halves). Payloads are raw bytes in the model's dtype, in
a fixed order, so a loaded payload lands exactly where it was read from.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import xxhash

from kvserve.kvcache.specs import KVCacheSpec
from kvserve.model.checkpoint.resolve import resolve_checkpoint

FORMAT_VERSION = 1
PACKED_NUMBERS = 2
"""The packed weights' kernel's numbers (cpu_kernels/quant_matmul.c), in a quantized
engine's fingerprint: bumped when they change, so a tier never serves blocks another
kernel computed (2: each input block's scale divided, not multiplied by 1/127)."""


class KVBlockIO:
    """Reads and writes one group's slots of the runner's K/V tensors."""

    def __init__(
        self,
        kv_tensors: list[tuple[torch.Tensor, torch.Tensor]],
        layer_group: list[int],
        layer_slot: list[int],
    ) -> None:
        self.kv_tensors = kv_tensors
        self.group_slots: dict[int, list[int]] = {}
        for group, slot in zip(layer_group, layer_slot, strict=True):
            self.group_slots.setdefault(group, []).append(slot)

    def _parts(self, group: int, block: int, rows: slice) -> list[torch.Tensor]:
        parts = []
        for slot in self.group_slots[group]:
            k, v = self.kv_tensors[slot]
            parts.append(k[block, rows])
            parts.append(v[block, rows])
        return parts

    def payload_bytes(self, group: int, num: int | None = None) -> int:
        """The size of what `read(group, block, offset, num)` returns, without reading."""
        rows = slice(0, num)
        return sum(p.numel() * p.element_size() for p in self._parts(group, 0, rows))

    def read(self, group: int, block: int, offset: int = 0, num: int | None = None) -> bytes:
        """K/V of slots [offset, offset + num) of `block` (all of it when num is None)."""
        rows = slice(offset, None if num is None else offset + num)
        with torch.inference_mode():
            flat = torch.cat([p.reshape(-1) for p in self._parts(group, block, rows)])
            return flat.cpu().view(torch.uint8).numpy().tobytes()

    def write(
        self, group: int, block: int, data: bytes, offset: int = 0, num: int | None = None
    ) -> None:
        """The inverse of `read`; a payload of the wrong size is a ValueError."""
        rows = slice(offset, None if num is None else offset + num)
        parts = self._parts(group, block, rows)
        dtype = parts[0].dtype
        size = sum(p.numel() for p in parts) * parts[0].element_size()
        if len(data) != size:
            raise ValueError(f"payload of {len(data)} bytes for a {size}-byte block")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
        flat = flat.to(parts[0].device)
        with torch.inference_mode():
            start = 0
            for p in parts:
                n = p.numel()
                p.copy_(flat[start : start + n].view(p.shape))
                start += n


def weights_digest(model_dir: str | Path) -> str:
    """xxh3-128 over the checkpoint's files: the model's identity.

    A Hugging Face directory: config.json and every weight file, each with
    its name. A GGUF checkpoint: the .gguf file, which holds config and
    weights alike, under a fixed label (renaming the file changes nothing).
    Two checkpoints of one architecture differ only in their weights, and
    their K/V must never be mixed up; hashing reads at memory speed.
    """
    checkpoint = resolve_checkpoint(model_dir)
    if checkpoint.gguf is not None:
        files = [("model.gguf", checkpoint.gguf)]
    else:
        directory = checkpoint.directory
        paths = [directory / "config.json", *sorted(directory.glob("*.safetensors"))]
        files = [(path.name, path) for path in paths]
    h = xxhash.xxh3_128()
    for label, path in files:
        h.update(label.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def kv_fingerprint(
    model_dir: str | Path,
    dtype: torch.dtype,
    specs: list[KVCacheSpec],
    hash_block_size: int,
    hash_fn: str,
    hash_seed: int,
    quantization: str = "none",
    matmul: str | None = None,
) -> bytes:
    """32 bytes naming everything a stored block's meaning depends on (`matmul`: the fast
    mode's float matmuls, whose last bits differ from the exact mode's: "panels-float32"
    or "panels-bfloat16" on kvserve's kernels, "onednn-packed" for float32 on oneDNN's;
    None: the exact mode's)."""
    described: dict[str, object] = {
        "version": FORMAT_VERSION,
        "model": weights_digest(model_dir),
        "dtype": str(dtype),
        "specs": [repr(s) for s in specs],
        "hash_block_size": hash_block_size,
        "hash_fn": hash_fn,
        "hash_seed": hash_seed,
    }
    if quantization != "none":  # packed weights compute other K/V; float keys stay as they were
        described["quantization"] = quantization
        described["packed_numbers"] = PACKED_NUMBERS
    if matmul is not None and quantization == "none":  # the exact mode's keys as they were
        described["matmul"] = matmul
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()
