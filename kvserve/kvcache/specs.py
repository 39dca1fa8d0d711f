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
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes
        return per_layer * self.num_layers


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Each token attends to the last `sliding_window` tokens (itself included).

    Blocks that fall wholly out of the window are freed while the request
    runs, and a prefix hit needs only the window's blocks.
    """

    block_size: int
    sliding_window: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype_bytes: int = 2
    num_layers: int = 1

    kind = "sliding_window"

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def page_bytes(self) -> int:
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes
        return per_layer * self.num_layers


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


def spec_from_name(text: str, block_size: int) -> KVCacheSpec:
    """'full' or 'sliding:<window>' (the CLI's spelling of a group)."""
    kind, _, arg = text.partition(":")
    if kind == "full" and not arg:
        return FullAttentionSpec(block_size=block_size)
    if kind == "sliding" and arg.isdigit():
        return SlidingWindowSpec(block_size=block_size, sliding_window=int(arg))
    raise ValueError(f"bad group spec {text!r}: use 'full' or 'sliding:<window tokens>'")
