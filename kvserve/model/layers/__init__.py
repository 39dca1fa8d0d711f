"""The layers decoders are built from: RMSNorm, rotary embedding, gated MLP (common.py)
and the Mamba2 mixer over paged state (mamba2.py).

Imports of other model rooms: only `checkpoint` (the config).
"""
