"""How a pooling request turns its prompt's final hidden states into one vector.

vLLM's pooling runner on decoder models: the prompt is prefilled (no token is
sampled) and its final hidden states (after the model's last norm) are pooled
by one rule, then L2-normalized. `last` is vLLM's default for decoder models
(the last token has seen the whole prompt); `mean` averages every prompt
token's state.

How the engine runs one (`PoolingParams` given to `add_request` instead of
SamplingParams; `LLM.embed`, `/v1/embeddings`): the scheduler runs it as any prompt
(chunks, prefix hits, preemption); its chunks reach the runner with `sample` False and
`pooling` set; the runner's `Pooler` (kvserve.model.pooling) reads the step's final hidden
states of those chunks only (generation pays one attribute check per chunk) and answers
the embedding in `StepOutput.embeddings` when the chunk ends the prompt; the engine puts
it on the `Request`, and the scheduler's update finishes the request (`stop`) instead of
appending a token. `last` pooling reads and fills the prefix cache like any prompt (a
fully cached prompt recomputes its last token, docs/design.md invariant 5: the one state
it needs). `mean` pooling needs every prompt token's state, which no cached block keeps:
the engine gives it a cache salt of its own, so it computes its whole prompt, and its
blocks are neither read from nor shared with others.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_RULES = ("last", "mean")


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """A pooling request's rule; `LLMEngine.add_request` takes it instead of SamplingParams.

    `last` reads the prefix cache like any prompt (only the last token must be
    computed). `mean` needs every prompt token's state, which a cached block does
    not keep: a mean request recomputes its whole prompt (kvserve.engine.llm_engine
    gives it a cache salt of its own, so it neither reads nor duplicates shared blocks).
    """

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_RULES:
            raise ValueError(f"pooling must be one of {POOLING_RULES}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError("normalize must be True or False")
