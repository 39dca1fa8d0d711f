"""How a layer reads the paged KV cache: the attention backends ("plain", "flex",
"triton"), each step's metadata for them, and the decode steps replayed as CUDA graphs.

Imports of other model rooms: only `layers.mamba2`, for a Mamba group's step metadata.

The backends (`attention_backend`) give the same outputs within float rounding, and every
one writes all new K/V of the step before any read (docs/design.md invariant 8):

- `plain` (default, the CPU's fastest): torch ops per fresh or chunked prefill and per
  padded decode group (`AttentionMetadata`); a fresh prefill without a window runs SDPA's
  `is_causal` (`SeqSpan.causal`: its mask's bits, the blocks above the diagonal skipped).
- `flex` (for a GPU): the whole step in one compiled FlexAttention call per layer
  (`FlexMetadata`: every query token's sequence and position, every context key's slot,
  a BlockMask).
- `triton` (for CUDA): one Triton kernel per layer and step that reads the pages in place
  through the block tables (`PagedMetadata`: nothing per key), its decode steps replayed
  from CUDA graphs.

Decode rows that share a prefix (identical prompts, `n` > 1, a common system prompt) run
like any other decode row, each over its own block table: the shared blocks are shared in
memory (one physical copy, invariant 7), not in the computation. Reading a shared prefix
once per decode group, measured, was slower on every batch and changed bfloat16 tokens
(benchmarks/README.md, "Decode over shared prefixes"). Decode rows are sorted by context
length and padded in groups of `DECODE_GROUP` (16); up to 16 stay one group in batch order
(a decode-only batch is then attended without moving its rows). A group's rows read
positions 0 .. n-1 (a window group: its last W), padding reads the null block.

Files:

    step_metadata.py what a step's layers read, one metadata per KV cache group: the
                    attention backend's, or a Mamba group's StateMetadata
    plain.py        paged_attention, every layer's call: the "plain" backend in torch
                    ops (fresh or chunked prefills, padded decode groups; bfloat16
                    decodes and causal prefills on the CPU by cpu_kernels/); flex and
                    triton steps sent to their backend
    attention_metadata.py the "plain" backend's step: write slots, prefill spans, decode
                    groups
    flex_metadata.py the "flex" backend's step as tensors: packed queries (sequence id,
                    position), packed context slots gathered through the block
                    tables, the BlockMask built from them (no dense mask)
    flex_attention.py the "flex" backend: one compiled FlexAttention call per layer
                    over the whole step (windows in mask_mod, soft-cap as score_mod,
                    GQA), shapes bucketed to powers of two from 128
    paged_metadata.py the "triton" backend's step: per token its write slot (-1: not
                    written), per sequence its first query's index and position and
                    its block-table row; one copy to the device
    triton_attention.py the "triton" backend (CUDA; the CPU tests use Triton's
                    interpreter): the launchers, each kernel variant's constants,
                    how many ways a small decode batch splits its contexts
    triton_kernels.py its kernels: K/V stored at their slots; one attention kernel
                    per layer and step that walks each context through its block
                    table in place (windows, soft-cap, GQA, online softmax in
                    float32); the merge of a split decode's partial outputs
    decode_graphs.py decode steps replayed from CUDA graphs, one per batch bucket,
                    over static input buffers (padding rows write nothing and read
                    the null block); `enforce_eager` turns them off
"""
