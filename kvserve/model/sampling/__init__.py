"""From logits to tokens: penalties and logit bias, the sampler, top-k logprobs.

Imports no other model room.

Files:

    penalties.py    repetition, presence and frequency penalties, logit bias
    grammar_mask.py constrained rows' token bitmasks (filled from each row's grammar
                    state) applied to their logits first, padding columns included
    sampler.py      temperature, top-k / top-p / min-p, seeded draws per request
    draw.py         one token per row by the inverse CDF (one uniform per row, two-level
                    float64 search), each seeded row from its own generator
    logprobs.py     the sampled token's and the top-k tokens' logprobs (raw logits)
    speculative.py  draft verification: greedy (the argmax chain) or rejection
                    sampling (each emitted token distributed as the target's p)
    rows.py         a step's sampling redone row by row after the batched pass raised:
                    a failing row fails its request alone

Penalties and logit bias are stateless, rebuilt from the chunk's tokens, and applied only
on the rows that use them.
"""
