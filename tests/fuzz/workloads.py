"""Random workloads for the differential fuzzer: requests and the engine options they meet.

A workload is plain data (JSON in, JSON out), so a finding is reproduced by
its printed workload alone. It is drawn to make the cache work hard: prompts
from a few shared prefixes (and identical prompts), `n` > 1 with seeds that
make one completion of an `n` request continue exactly as another request
does, arrivals spread over steps, aborts, and a pool sized around the
largest request so that requests are preempted and cached blocks evicted,
with chunked prefill, the CPU and disk tiers, speculative decoding and LoRA
adapters (two, and the base model, in one batch).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

VOCAB = (3, 300)
"""Token ids drawn from [3, 300): inside every tiny checkpoint's vocabulary (320)."""

ALL_SLIDE = {"mistral", "phi3"}
"""Every layer slides: no full-attention group anchors the windows."""

STATE = {"bamba"}
"""Mamba2 state groups: a state cannot be rewound, so no speculative decoding."""


@dataclass
class FuzzRequest:
    """One request of a workload; `seed` None is greedy."""

    prompt: list[int]
    max_tokens: int
    n: int = 1
    seed: int | None = None
    arrival: int = 0
    """The engine step it is added before."""
    abort_at: int | None = None
    """The engine step it is aborted before (never compared if it had not finished)."""
    adapter: int | None = None
    """Which of the fuzzer's LoRA adapters it runs with (tests/fuzz/adapters.py); None:
    the base model."""

    def key(self, index: int) -> tuple[Any, ...]:
        """What its completion `index` depends on alone (the reference cache's key)."""
        seed = None if self.seed is None else self.seed + index
        return (tuple(self.prompt), self.max_tokens, seed, self.adapter)


@dataclass
class Workload:
    arch: str
    options: dict[str, Any]
    """Engine options (LLM keyword arguments): block size, pool, chunk, tiers, drafts.
    `offload` may name the tier folder as {dir}: the run fills in a fresh one."""
    requests: list[FuzzRequest] = field(default_factory=list)
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        requests = [FuzzRequest(**r) for r in data.get("requests", ())]
        return cls(data["arch"], dict(data["options"]), requests, data.get("seed", 0))


def _tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(length)]


def _cycle(rng: random.Random, length: int) -> list[int]:
    """A short cycle repeated: prompt lookup finds drafts, and the model may follow them."""
    unit = _tokens(rng, rng.randint(1, 3))
    return (unit * length)[:length]


def random_workload(rng: random.Random, arch: str, num_groups: int) -> Workload:
    """A workload for `arch`, whose pool has `num_groups` KV cache groups."""
    seed = rng.randrange(2**31)
    lora = rng.random() < 0.25
    bs = rng.choice([2, 4, 4, 8, 16])
    speculative = arch not in STATE and rng.random() < 0.3
    make = _cycle if speculative and rng.random() < 0.7 else _tokens
    prefixes = [make(rng, rng.randint(0, 40)) for _ in range(rng.randint(1, 3))]
    requests: list[FuzzRequest] = []
    for _ in range(rng.randint(1, 7)):
        if requests and rng.random() < 0.25:  # the very same prompt again
            prompt = list(rng.choice(requests).prompt)
        else:
            prompt = rng.choice(prefixes) + make(rng, rng.randint(0, 12))
        if not prompt:
            prompt = _tokens(rng, rng.randint(1, 6))
        seeded = not speculative and rng.random() < 0.35
        requests.append(
            FuzzRequest(
                prompt=prompt,
                max_tokens=rng.randint(1, 24),
                n=rng.choice([1, 1, 1, 2, 3, 4]),
                seed=rng.choice([7, 11]) if seeded else None,
                arrival=rng.choice([0, 0, 0, rng.randint(1, 30)]),
                abort_at=rng.randint(1, 40) if rng.random() < 0.12 else None,
                adapter=rng.choice([None, 0, 1]) if lora else None,
            )
        )
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    blocks = num_groups * -(-longest // bs)
    options: dict[str, Any] = {
        "block_size": bs,
        # Around the largest request: tight pools preempt and evict; a request that can
        # never fit is refused at admission (the run drops it and says so).
        "num_kv_blocks": max(4, int(blocks * rng.uniform(0.7, 3.0))),
        "max_num_batched_tokens": rng.choice([4, 8, 16, 32, 2048]),
        "max_num_seqs": rng.choice([2, 4, 8, 16]),
    }
    if lora:
        options.update(enable_lora=True, max_loras=rng.choice([1, 2]))
    tier = rng.random()
    if tier < 0.2:
        options["offload"] = "cpu:4MiB"
    elif tier < 0.3:
        options["offload"] = "disk:{dir}:8MiB"
    elif tier < 0.35:
        options["offload"] = "cpu:1MiB,disk:{dir}:8MiB"
    if speculative:
        k = rng.randint(1, 4)
        # A draft model's K/V does not travel to the tiers: refused with offload.
        if arch not in ALL_SLIDE and "offload" not in options and rng.random() < 0.3:
            options["speculative_config"] = {"method": "draft_model", "model": "{self}",
                                             "num_speculative_tokens": k}  # fmt: skip
        else:
            options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                             "prompt_lookup_max": 3}  # fmt: skip
    return Workload(arch, options, requests, seed)
