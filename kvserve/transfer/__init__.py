"""KV transfer between engines: a prefill engine's blocks pulled by a decode engine.

Built on the external tiers (kvserve.offload), whose two-phase path already places
an external hit exactly for every group kind (full attention, the last window of a
sliding window, a Mamba state snapshot where the hit ends): the producer keeps what it
computed in its CPU tier and serves it (server.py); the consumer looks blocks up in
the producer's tier as one more, read-only tier of its own (remote_tier.py; all its
producers together, named in its config or told of while it runs: producers.py), keyed by
(group, content hash) and checked by a checksum, so a block either arrives whole and
verified or is a miss, recomputed with what follows it. A request's whole run of blocks
travels in one round trip (up to 1,024 keys an ask). config.py reads vLLM's
`kv_transfer_config`. Engines publish where they serve and whom they read in their
event metadata, so a router's event mirror predicts a consumer's hit, pulled blocks
included (kvserve.events.index).

The transport is ZMQ over TCP (pyzmq, already the KV events' transport): loopback on
one machine, TCP across machines. The field's libraries, tried on a 2-core x86 machine
without GPU or RDMA (2026-11-28):

- NIXL 1.5.1 (`pip install nixl`: nixl-cu12 and nixl-cu13 wheels, with torch) imports
  and moves bytes with its UCX backend: two agents, DRAM to DRAM, a 64 MiB WRITE in one
  process and a READ across two processes with UCX_TLS=tcp (metadata and descriptors
  exchanged out of band), the bytes verified. 0.2-0.6 GB/s on that machine while it was
  loaded, no faster than ZMQ there. Memory must be registered (a torch tensor, or an
  address with a mem type: a numpy array alone is refused, "Please specify a mem type
  if not using Tensors"), and UCX_TLS=shm,self fails at agent start ("no active
  messages transport ... NIXL_ERR_BACKEND").
- Mooncake's transfer engine 0.3.13.post1: `mooncake-transfer-engine` fails at import
  ("ImportError: libcudart.so.12: cannot open shared object file"), and
  `mooncake-transfer-engine-non-cuda` at import too ("ImportError: libibverbs.so.1:
  cannot open shared object file"): it needs the RDMA verbs library even for TCP.

So ZMQ stays: it runs everywhere pyzmq does, and NIXL would first need the CPU tier's
blocks in registered memory to be worth its setup. Neither is a dependency.
"""
