"""The KV pool's memory: layers grouped into KV cache groups, each layer's view into the
shared tensors, the pool's budget and size, scratch steps, warm-up, KV bytes for the tiers.

Imports of other model rooms: `checkpoint` (the config, the path) and `layers.mamba2`
(a state page's shapes).
"""
