"""What a group of layers stores per block: the spec that decides its manager."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Every token's K/V stays for the whole request.

    The byte fields size a page for the runner; the manager only needs
    `block_size` (tokens per physical block).
    """

    block_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype_bytes: int = 2
    num_layers: int = 1

    kind = "full_attention"

    @property
    def page_bytes(self) -> int:
        """Bytes of one block across the group's layers (K and V)."""
        return (
            2
            * self.block_size
            * self.num_kv_heads
            * self.head_size
            * self.dtype_bytes
            * (self.num_layers)
        )


KVCacheSpec = FullAttentionSpec
