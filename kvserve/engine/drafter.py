"""Which requests draft this step, their draft tokens, and what verification told them.

The scheduler asks `Drafter.drafts` for each running request about to decode
and hands the answer to `allocate_slots` as lookahead slots. Prompt lookup
answers with the tokens themselves; a draft model (kvserve.model.draft_model)
can only propose once the slots are there, so its answer is `PENDING_DRAFT`
placeholders, one per slot, which the engine replaces with the draft model's
tokens before the target runs the step (the runner refuses a negative id,
so a placeholder can never be computed); after the step
`verified` folds the result into the request's back-off (SpecState) and the
engine's counters. Requests whose sampling reads more than the logits of one
position (logprobs, grammars, penalties and bias, min_tokens not reached)
never draft: their verification would need per-position state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.engine.ngram import propose_ngram
from kvserve.engine.request import Request
from kvserve.engine.speculative import SpecDecodeStats, SpecState, SpeculativeConfig
from kvserve.kvcache.specs import KVCacheSpec, MambaStateSpec
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.batch import Runner
    from kvserve.model.draft_model import DraftModel

PENDING_DRAFT = -1
"""A lookahead slot whose token the draft model proposes when the step runs."""


class Drafter:
    """Prompt-lookup drafts (kvserve.engine.ngram), or a draft model's slots, under one
    `SpeculativeConfig`."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats()

    @classmethod
    def build(cls, config: Any, specs: list[KVCacheSpec]) -> Drafter | None:
        """The drafter `speculative_config` asks for (None: off). Refused (ValueError) for a
        model with Mamba state: its running state cannot be rewound past a rejected
        draft, and a wrong answer is worse than a slower one."""
        if config is None:
            return None
        spec = SpeculativeConfig.from_any(config)
        if any(isinstance(group, MambaStateSpec) for group in specs):
            raise ValueError(
                "speculative_config: this model keeps Mamba state, which cannot be rewound "
                "past a rejected draft token; speculative decoding is refused for it"
            )
        return cls(spec)

    def state_for(self, params: SamplingParams) -> SpecState | None:
        """A new sequence's speculation state; None where its sampling cannot be verified
        from the logits alone (logprobs, a grammar, penalties or logit bias)."""
        if params.logprobs is not None or params.structured_outputs is not None:
            return None
        if params.adjusts_logits:
            return None
        return SpecState()

    def drafts(self, req: Request, budget: int, max_model_len: int | None) -> list[int]:
        """Draft tokens for `req` this step (empty: decode plainly)."""
        spec = req.spec
        if spec is None or len(req.token_ids) - req.num_computed_tokens != 1:
            return []
        if req.num_output_tokens < req.params.min_tokens:
            return []  # its stop tokens are banned per position: no drafts until then
        config = self.config
        room = min(
            config.num_speculative_tokens,
            budget - 1,
            req.max_tokens - req.num_output_tokens - 1,  # the step adds accepted + 1
        )
        if max_model_len is not None:
            room = min(room, max_model_len - len(req.token_ids))
        if room < 1 or not spec.drafting():
            return []
        if config.method == "draft_model":
            return [PENDING_DRAFT] * room
        return propose_ngram(
            req.token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """The runner accepted `num_accepted` of the request's `num_drafts` drafts."""
        self.stats.record(num_drafts, num_accepted, self.config.num_speculative_tokens)
        if req.spec is not None:
            req.spec.verified(num_drafts, num_accepted)

    def stats_dict(self) -> dict[str, Any]:
        """The counters under the names `LLM.stats()` and `generate`'s summary use."""
        stats = self.stats
        return {
            "spec_num_drafts": stats.num_drafts,
            "spec_draft_tokens": stats.num_draft_tokens,
            "spec_accepted_tokens": stats.num_accepted_tokens,
        }


def draft_model_path(config: Any) -> str | None:
    """The draft checkpoint a "draft_model" `speculative_config` names (None otherwise): the
    model runner loads it beside the target, before sizing the pool."""
    if config is None:
        return None
    spec = SpeculativeConfig.from_any(config)
    return spec.model if spec.method == "draft_model" else None


def draft_model_for(
    drafter: Drafter | None, runner: Runner, max_model_len: int | None
) -> DraftModel | None:
    """The runner's draft model for a "draft_model" config (None for other methods).
    Refused (ValueError) over a runner without one (simulate's model-free runner) and for
    a draft that reads fewer positions than `max_model_len`."""
    if drafter is None or drafter.config.method != "draft_model":
        return None
    draft: DraftModel | None = getattr(runner, "draft", None)
    if draft is None:
        raise ValueError(
            "speculative_config: method 'draft_model' needs a model runner that loaded the "
            f"draft, not {type(runner).__name__} (simulate: use method 'ngram')"
        )
    if max_model_len is not None and draft.max_positions < max_model_len:
        raise ValueError(
            f"speculative_config: the draft model reads {draft.max_positions} positions, "
            f"fewer than max_model_len {max_model_len} (lower max_model_len or use another "
            "draft)"
        )
    return draft
