"""What a group of layers stores per block: the spec that decides its manager."""

from __future__ import annotations

from dataclasses import dataclass, replace


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


@dataclass(frozen=True, slots=True)
class MambaStateSpec:
    """A recurrent (Mamba2) layer: a fixed-size state per request, not per token.

    The state can only be resumed from a snapshot, so prefix hits exist only
    where one was taken: when an attention block of `block_size` tokens fills,
    and at the last hash-block boundary of each prompt. `state_bytes` is the
    conv plus SSM state of one layer.
    """

    block_size: int
    state_bytes: int = 1
    num_layers: int = 1

    kind = "mamba"

    @property
    def page_bytes(self) -> int:
        return self.state_bytes * self.num_layers


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaStateSpec


def spec_from_name(text: str, block_size: int) -> KVCacheSpec:
    """'full', 'sliding:<window>' or 'mamba:<k>' (the CLI's spelling of a group).

    'mamba:<k>': a state group whose state page is as large as k hash blocks of
    a 'full' group, so attention blocks beside it are inflated k-fold.
    """
    kind, _, arg = text.partition(":")
    if kind == "full" and not arg:
        return FullAttentionSpec(block_size=block_size, dtype_bytes=1)
    if kind == "sliding" and arg.isdigit():
        return SlidingWindowSpec(block_size=block_size, sliding_window=int(arg), dtype_bytes=1)
    if kind == "mamba" and arg.isdigit() and int(arg) > 0:
        return MambaStateSpec(block_size=block_size, state_bytes=int(arg) * 2 * block_size)
    raise ValueError(
        f"bad group spec {text!r}: use 'full', 'sliding:<window tokens>' or "
        "'mamba:<state page in hash blocks>'"
    )


def inflate_for_state(specs: list[KVCacheSpec]) -> list[KVCacheSpec]:
    """One page size for attention and state groups: grow the attention block.

    A state page (a whole request's recurrent state) is usually far larger
    than one hash block of K/V, so attention blocks become k hash blocks,
    the smallest k whose page holds a state page (vLLM does the same). The
    hash block size, the unit of matching and events, is unchanged; state
    groups take the physical block size as their snapshot interval.
    """
    if not any(isinstance(s, MambaStateSpec) for s in specs):
        return specs
    if any(isinstance(s, SlidingWindowSpec) for s in specs):
        raise ValueError("sliding-window layers together with Mamba state layers are not supported")
    attention = [s for s in specs if isinstance(s, FullAttentionSpec)]
    if not attention:
        raise ValueError(
            "Mamba state layers need at least one full-attention layer: prefix hits are "
            "verified against the attention blocks (pure Mamba models are not supported)"
        )
    hash_block_size = attention[0].block_size
    if any(s.block_size != hash_block_size for s in specs):
        raise ValueError("every layer spec must start from the same (hash) block size")
    state_page = max(s.page_bytes for s in specs if isinstance(s, MambaStateSpec))
    per_hash_block = max(s.page_bytes for s in attention)
    k = max(1, -(-state_page // per_hash_block))
    return [replace(s, block_size=k * hash_block_size) for s in specs]
