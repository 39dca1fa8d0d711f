"""KV transfer between engines: a prefill engine's blocks pulled by a decode engine.

Built on the external tiers (kvserve.offload), whose two-phase path already places
an external hit exactly for every group kind (full attention, the last window of a
sliding window, a Mamba state snapshot where the hit ends): the producer keeps what it
computed in its CPU tier and serves it (server.py); the consumer looks blocks up in
the producer's tier as one more, read-only tier of its own (remote_tier.py; all its
producers together, named in its config or told of while it runs: producers.py), keyed by
(group, content hash) and checked by a checksum, so a block either arrives whole and
verified or is a miss, recomputed. config.py reads vLLM's `kv_transfer_config`.

The transport is ZMQ over TCP (pyzmq, already the KV events' transport). NIXL (UCX)
and Mooncake's transfer engine were not tried yet on these CPU machines.
"""
