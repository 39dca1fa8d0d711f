"""Event fidelity: a subscriber that applies the stream predicts every engine hit exactly.

Two comparisons, through real ZMQ on loopback:

- before each step (after the step's arrivals are queued) the subscriber is
  brought up to the engine's last published batch, and for every waiting
  request its index's `match` must equal `get_computed_blocks(req, 0)`;
- at each admission inside the step, the hit the scheduler actually uses must
  equal what the subscriber's view predicts once the events the step has
  recorded so far (not yet published) are applied to a copy of it: same-step
  sharing and evictions by requests admitted earlier in the step are events
  too. A state model defers a request whose hit would read state written in
  that step (`hit.wait`); it is compared at the step where it is admitted.

Small pools force evictions and preemptions, so BlockRemoved and stale links
are exercised too. Hybrid Mamba cases run inflated attention blocks (4 hash
blocks each) next to state groups, with prompts shorter than one physical
block among them (vLLM #43258: inflation silenced events for short prompts).
"""

from __future__ import annotations

import dataclasses

import pytest
from _stream_checks import StreamChecker

from kvserve.engine.request import RequestStatus
from kvserve.events import KVEventSubscriber, PrefixIndex
from kvserve.kvcache.events import KVEventBatch
from kvserve.kvcache.hashing import BlockHasher
from kvserve.simulate.simulator import SimConfig, simulate
from kvserve.simulate.workloads import WORKLOADS

SMALL = {
    "shared-prefix": dict(
        num_groups=3, prompts_per_group=5, system_len=120, question_len=24, output_len=12
    ),
    "multi-turn": dict(num_conversations=4, num_turns=3, turn_len=24, output_len=16),
    "random": dict(num_requests=16, min_len=10, max_len=90),
    "identical-burst": dict(num_requests=4, prompt_len=70, output_len=12),
}
SHORT = {
    # Prompts shorter than one inflated block (16 tokens at hash block size 4).
    "shared-prefix": dict(
        num_groups=3, prompts_per_group=4, system_len=8, question_len=3, output_len=6
    ),
    "multi-turn": dict(num_conversations=4, num_turns=4, turn_len=5, output_len=4),
    "identical-burst": dict(num_requests=4, prompt_len=9, output_len=5),
}


class Follower:
    """The before_step hook: keeps a subscriber in step and compares its predictions."""

    def __init__(self, ports, int_hashes: bool, block_size: int, hash_fn: str) -> None:
        self.ports = ports
        self.sub: KVEventSubscriber | None = None
        hasher = None if int_hashes else BlockHasher(block_size, hash_fn)
        self.checker = StreamChecker(hasher, block_size)
        self.compared = self.nonzero = self.admissions = self.deferred = 0
        self._lookup = None

    def __call__(self, scheduler, kv_events) -> None:
        if self.sub is None:
            self.sub = KVEventSubscriber(
                self.ports.connect, self.ports.replay_connect, on_batch=self.checker
            )
            self._watch_admissions(scheduler, kv_events)
        self.sub.wait_for(kv_events.publisher.last_seq)
        engine = self.sub.engine
        for req in scheduler.waiting:
            hit = self._lookup(req.request_id, 0)  # type: ignore[misc]
            assert not hit.wait, "between steps every block is computed"
            predicted = self.sub.index.match(req.token_ids)[engine]
            assert predicted == hit.num_tokens, (
                f"{req.request_id}: subscriber predicts {predicted}, engine hits {hit.num_tokens}"
            )
            self.compared += 1
            self.nonzero += bool(hit.num_tokens)

    def _watch_admissions(self, scheduler, kv_events) -> None:
        """Wrap the manager's lookup: compare every admission's hit inside the step."""
        manager = scheduler.manager
        self._lookup = lookup = manager.get_computed_blocks

        def admission(request_id: str, num_computed_tokens: int = 0):
            hit = lookup(request_id, num_computed_tokens)
            waiting = [r for r in scheduler.waiting if r.request_id == request_id]
            req = waiting[0] if waiting else None
            if req is not None and req.status == RequestStatus.WAITING:
                self._check_admission(req, hit, kv_events)
            return hit

        manager.get_computed_blocks = admission

    def _check_admission(self, req, hit, kv_events) -> None:
        if hit.wait:
            self.deferred += 1  # it resumes from state this step writes: admitted later
            return
        view = self.sub.view  # type: ignore[union-attr]
        ahead = dataclasses.replace(view, groups=[dict(g) for g in view.groups])
        ahead.apply(KVEventBatch(0.0, list(kv_events.sink.events)))
        predicted = PrefixIndex({"ahead": ahead}).match(req.token_ids)["ahead"]
        assert predicted == hit.num_tokens, (
            f"{req.request_id} at admission: view predicts {predicted}, "
            f"engine hits {hit.num_tokens}"
        )
        self.admissions += 1

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()


MAMBA = ("full", "mamba:4", "mamba:4")
CASES = [
    # workload, groups, num_blocks (None: ample), block size, int hashes
    ("shared-prefix", ("full",), None, 16, True),
    ("shared-prefix", ("full",), 40, 8, False),
    ("multi-turn", ("full",), 30, 8, True),
    ("random", ("full",), 50, 8, True),
    ("identical-burst", ("full",), None, 16, False),
    ("shared-prefix", ("full", "sliding:17"), None, 8, True),
    ("shared-prefix", ("full", "sliding:20"), 90, 8, True),
    ("multi-turn", ("full", "sliding:33"), 60, 8, False),
    ("random", ("full", "sliding:16", "sliding:40"), 150, 8, True),
    ("multi-turn", ("sliding:20",), 40, 8, True),  # Mistral: every layer slides, no anchor
    ("shared-prefix", ("full", "full"), 60, 8, True),
    ("shared-prefix", MAMBA, None, 4, True),
    ("shared-prefix", MAMBA, 70, 4, False),
    ("multi-turn", MAMBA, 40, 4, True),
    ("multi-turn", ("full", "full", "mamba:2"), 60, 8, False),
    ("identical-burst", MAMBA, None, 4, True),
]


def run_case(ports, workload, params, groups, num_blocks, block_size, int_hashes):
    follower = Follower(ports, int_hashes, block_size, "sha256")
    config = SimConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        groups=groups,
        max_num_batched_tokens=128,
        max_num_seqs=2 if workload == "identical-burst" else 256,  # later ones wait, then hit
        check=True,
        kv_events_config=ports.config(int_block_hashes=int_hashes),
    )
    try:
        report = simulate(WORKLOADS[workload](**params), config, before_step=follower)
    finally:
        follower.close()
    assert follower.compared >= report["requests"]
    assert follower.admissions >= report["requests"]
    assert follower.nonzero > 0, "no request hit: the comparison proved nothing"
    assert follower.checker.num_stored > 0
    if num_blocks is not None:
        assert report["evictions"] > 0 and follower.checker.num_removed > 0
    return follower


@pytest.mark.parametrize(("workload", "groups", "num_blocks", "block_size", "int_hashes"), CASES)
def test_subscriber_predicts_every_hit(ports, workload, groups, num_blocks, block_size, int_hashes):
    follower = run_case(
        ports, workload, SMALL[workload], groups, num_blocks, block_size, int_hashes
    )
    if "mamba:4" in groups or "mamba:2" in groups:
        kinds = follower.checker.stored_by_kind
        assert kinds.get("mamba", 0) > 0 and kinds.get("full_attention", 0) > 0


@pytest.mark.parametrize(
    ("workload", "num_blocks"),
    [
        ("shared-prefix", None),
        ("shared-prefix", 24),
        ("multi-turn", None),
        ("multi-turn", 24),
        ("identical-burst", None),
    ],
)
def test_short_prompts_in_inflated_blocks_are_advertised_and_hit(ports, workload, num_blocks):
    """Every prompt is shorter than one physical block: events per hash block, hits exact."""
    follower = run_case(ports, workload, SHORT[workload], MAMBA, num_blocks, 4, False)
    kinds = follower.checker.stored_by_kind
    assert kinds.get("mamba", 0) > 0 and kinds.get("full_attention", 0) > 0
