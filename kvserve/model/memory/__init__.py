"""The KV pool's memory: layers grouped into KV cache groups, each layer's view into the
shared tensors, the pool's budget and size, scratch steps, warm-up, KV bytes for the tiers;
and, on the CPU, the weights' pages.

Imports of other model rooms: `checkpoint` (the config, the path) and `layers.mamba2`
(a state page's shapes).

Files:

    layer_groups.py layers -> KV cache groups that share one pool (one page size)
    kv_layout.py    per-layer KV specs, and each layer's view into the shared (K, V)
                    tensors (a Mamba layer's state pages)
    kv_memory.py    the pool's budget (CPU: from RAM; CUDA: gpu_kv_cache_memory, plain
                    numbers) and the K/V tensors' allocation
    pool_size.py    the CUDA pool: total memory x gpu_memory_utilization, less what is
                    in use and the profiled activation peak of the largest steps
    scratch.py      dummy steps on a two-block scratch cache swapped in for the pool:
                    the real step path, nothing of the pool, manager or generators touched
    warmup.py       dummy prefills and decodes of bucketed sizes at start (accelerators)
    kv_io.py        a block's K/V as bytes for the external tiers, and the checkpoint's
                    fingerprint that keys them
    huge_pages.py   a CPU model's weights copied once onto 2 MiB pages after loading
"""
