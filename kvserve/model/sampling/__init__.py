"""From logits to tokens: penalties and logit bias, the sampler, top-k logprobs.

Imports no other model room.
"""
