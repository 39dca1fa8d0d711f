"""A runner without a model, for `simulate`: prefill is free, decode is a rolling hash.

Each sampled token is a function of the request's whole token sequence so far
(kept as a rolling state, so a step costs O(1)), the way greedy decoding
behaves: identical prompts continue identically, so generated blocks are
cacheable, and a later turn's prompt may contain an earlier answer. It sits
behind the same `Runner` interface as the model runner, so `simulate` runs
the engine's own step loop.

With external tiers (`simulate --offload`) it also keeps each position's
"K/V", its token id, so what the tiers load can be checked (model_free_kv).

There are no logits: penalties and logit bias change nothing, and a request
that asks for logprobs gets those of a point mass on the token it gets
(logprob 0.0, rank 1, no other token listed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.batch import SeqChunk, StepOutput, TokenLogprobs
from kvserve.engine.model_free_kv import ModelFreeKV
from kvserve.kvcache.specs import FullAttentionSpec, KVCacheSpec

_MASK = (1 << 64) - 1
_MULT = 0x100000001B3
SAMPLED_VOCAB = 32000
"""Sampled tokens fall in [0, SAMPLED_VOCAB); prompts may use any uint32 id."""


def _mix(state: int, token: int) -> int:
    return ((state ^ token) * _MULT) & _MASK


class ModelFreeRunner:
    """The KV cache layout a simulation asks for, and tokens without a model."""

    def __init__(
        self,
        kv_cache_specs: list[KVCacheSpec] | None = None,
        num_blocks: int = 2,
        hash_block_size: int = 16,
        sampled_vocab: int = SAMPLED_VOCAB,
        kv_bytes_per_token: int | None = None,
    ) -> None:
        """The layout is what an engine over this runner builds its KV cache from
        (default: one full-attention group). `kv_bytes_per_token`: keep the K/V
        (token ids, see model_free_kv) for external tiers, at this size per token."""
        self.kv_cache_specs = kv_cache_specs or [FullAttentionSpec(block_size=hash_block_size)]
        self.kv = (
            None
            if kv_bytes_per_token is None
            else ModelFreeKV(self.kv_cache_specs, kv_bytes_per_token)
        )
        self.num_blocks = num_blocks
        self.hash_block_size = hash_block_size
        self.vocab_size = 2**32
        """Any token id the KV cache can hash (traces bring their own ids)."""
        self.sampled_vocab = sampled_vocab
        self.eos_token_ids: set[int] = set()
        self.max_model_len: int | None = None
        self.model_dir: Path | None = None
        self.tokenizer: Any = None
        self._state: dict[str, tuple[int, int]] = {}
        """request id -> (tokens folded in, rolling state)."""

    def execute(self, chunks: list[SeqChunk]) -> StepOutput:
        """The next token of every chunk that reaches its sequence's end."""
        sampled: list[int | None] = []
        logprobs: list[TokenLogprobs | None] | None = None
        num_accepted: list[int] | None = None
        if self.kv is not None:
            for chunk in chunks:
                self.kv.run(chunk)
        for i, chunk in enumerate(chunks):
            if not chunk.sample:
                sampled.append(None)
                continue
            tokens = chunk.token_ids
            folded, state = self._state.get(chunk.request_id, (0, 0xCBF29CE484222325))
            for token in tokens[folded:]:
                state = _mix(state, token)
            self._state[chunk.request_id] = (len(tokens), state)
            token = (state >> 17) % self.sampled_vocab
            if chunk.draft_token_ids:  # verified against its own next tokens, like greedy
                accepted = 0
                for draft in chunk.draft_token_ids:
                    if draft != token:
                        break
                    state = _mix(state, draft)
                    token = (state >> 17) % self.sampled_vocab
                    accepted += 1
                num_accepted = num_accepted or [0] * len(chunks)
                num_accepted[i] = accepted
            sampled.append(token)
            if chunk.params is not None and chunk.params.logprobs is not None:
                if logprobs is None:
                    logprobs = [None] * len(chunks)
                top = [token] if chunk.params.logprobs else []
                logprobs[i] = TokenLogprobs(0.0, 1, top, [0.0] * len(top))
        return StepOutput(sampled, logprobs, num_accepted)

    def free_request(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        if self.kv is not None:
            self.kv.free_request(request_id)

    def release(self) -> None:
        """Nothing to give back early: token ids and hashes are small."""

    def kv_block_io(self, hash_block_size: int, hash_fn: str, hash_seed: int) -> tuple:
        """(block reader/writer, fingerprint) for the external tiers (EngineTiers)."""
        if self.kv is None:
            raise ValueError("external tiers without a model need the K/V size per token")
        return self.kv, self.kv.fingerprint(hash_block_size, hash_fn, hash_seed)
