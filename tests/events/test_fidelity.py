"""Event fidelity: a subscriber that applies the stream predicts every engine hit exactly.

Before each step (after the step's arrivals are queued), the subscriber is
brought up to the engine's last published batch, and for every waiting
request its index's `match` must equal `get_computed_blocks(...).num_tokens`,
the hit the scheduler then reports at admission. Small pools force evictions
and preemptions, so BlockRemoved and stale links are exercised too.
"""

from __future__ import annotations

import pytest
from _stream_checks import StreamChecker

from kvserve.events import KVEventSubscriber
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


class Follower:
    """The before_step hook: keeps a subscriber in step and compares its predictions."""

    def __init__(self, ports, int_hashes: bool, block_size: int, hash_fn: str) -> None:
        self.ports = ports
        self.sub: KVEventSubscriber | None = None
        hasher = None if int_hashes else BlockHasher(block_size, hash_fn)
        self.checker = StreamChecker(hasher)
        self.compared = self.nonzero = 0

    def __call__(self, scheduler, kv_events) -> None:
        if self.sub is None:
            self.sub = KVEventSubscriber(
                self.ports.connect, self.ports.replay_connect, on_batch=self.checker
            )
        self.sub.wait_for(kv_events.publisher.last_seq)
        engine = self.sub.engine
        for req in scheduler.waiting:
            expected = scheduler.manager.get_computed_blocks(req, 0).num_tokens
            predicted = self.sub.index.match(req.token_ids)[engine]
            assert predicted == expected, (
                f"{req.request_id}: subscriber predicts {predicted}, engine hits {expected}"
            )
            self.compared += 1
            self.nonzero += bool(expected)

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()


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
]


@pytest.mark.parametrize(("workload", "groups", "num_blocks", "block_size", "int_hashes"), CASES)
def test_subscriber_predicts_every_hit(ports, workload, groups, num_blocks, block_size, int_hashes):
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
        report = simulate(WORKLOADS[workload](**SMALL[workload]), config, before_step=follower)
    finally:
        follower.close()
    assert follower.compared >= report["requests"]
    assert follower.nonzero > 0, "no request hit: the comparison proved nothing"
    assert follower.checker.num_stored > 0
    if num_blocks is not None:
        assert report["evictions"] > 0 and follower.checker.num_removed > 0
