"""The layers decoders are built from: RMSNorm, rotary embedding, gated MLP (common.py)
and the Mamba2 mixer over paged state (mamba2.py).

Imports of other model rooms: only `checkpoint` (the config).

Files:

    common.py       RMSNorm, rotary embedding, gated MLP (transformers' arithmetic)
    moe.py          the sparse MoE block: the top-k router (transformers' ties), the
                    experts run grouped (each expert with tokens once a step), a
                    shared expert where the family has one (Qwen2-MoE)
    mamba2.py       the Mamba2 mixer over paged state; StateMetadata, a state group's
                    step (segments: where each request's state comes from and goes)
"""
