"""LoRA adapters: many fine-tunes of one base model on one engine, their KV cache apart.

- request.py (no torch): `LoRARequest`, vLLM's way to name an adapter, and `Adapter`,
  what the engine resolves it to: its files checked and the digest of their content,
  which is the adapter's identity in every block hash (the same name reloaded with
  other weights never hits the old blocks; two names for the same weights share).
- targets.py: the base model's projections an adapter may target (attention, MLPs,
  an MoE's shared expert and experts), wrapped, under PEFT's names.
- weights.py: an adapter's PEFT files read into per-projection (A, B, scaling),
  checked against the base model's projections (fused expert weights split per expert).
- layers.py: the wrapper, so each row of a mixed batch gets its own adapter (one
  pair of small matmuls per adapter in the step, not per request).
- modules.py (no torch): `--lora-modules` entries (`NAME=DIR` or vLLM's JSON form).
- slots.py: which adapters are resident (`max_loras`), which are kept loaded on the
  host (`max_cpu_loras`, least recently used out), and the step's rows per adapter.
"""

from kvserve.lora.request import Adapter, LoRARequest

__all__ = ["Adapter", "LoRARequest"]
