"""How a layer reads the paged KV cache: the attention backends ("plain", "flex",
"triton"), each step's metadata for them, and the decode steps replayed as CUDA graphs.

Imports of other model rooms: only `layers.mamba2`, for a Mamba group's step metadata.
"""
