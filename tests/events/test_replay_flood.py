"""A replay client that asks and never reads costs the publisher a bounded amount of memory.

Before the bound, each replay answer went into the client's ZMQ pipe at once: a client
that sent replay requests and never read grew the server by the whole replay buffer per
request (0.6 GB with the defaults), kept after it left. Real sockets on loopback here; the
hostile client's own receive side is made tiny so the answers stay on the publisher's side.
"""

from __future__ import annotations

import time

import zmq

from kvserve.events import KVEventSubscriber
from kvserve.events.replay import END_SEQ, MAX_PENDING, REPLAY_HWM
from tests.events.test_transport import Engine, assert_predicts

STEPS = 120
PROMPT_TOKENS = 4800  # one step's BlockStored: 1200 hashes and 4800 token ids, ~20 KB


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def big_prompt(i: int) -> list[int]:
    return [1000 + (i * 7919 + j) % 60000 for j in range(PROMPT_TOKENS)]


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def never_reading_client(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


def test_a_client_that_never_reads_is_bounded_and_others_are_served(ports):
    engine = Engine(ports.config(buffer_steps=1000), num_blocks=1300, groups=("full",))
    replies = engine.events.publisher._replies
    hostile = never_reading_client(ports.replay_connect)
    sub = None
    try:
        for i in range(STEPS):
            engine.step(big_prompt(i))
        time.sleep(0.2)
        before = rss_bytes()
        requests = 30  # unbounded, this was 30 x the buffer (~70 MB) held by the publisher
        for _ in range(requests):
            hostile.send_multipart([b"", (0).to_bytes(8, "big")])
        wait_until(lambda: replies.refused >= requests - MAX_PENDING - 1)
        time.sleep(0.3)
        assert replies.pending <= MAX_PENDING
        grown = rss_bytes() - before
        assert grown < 25 * 2**20, f"the publisher grew by {grown / 2**20:.0f} MiB"

        # A normal subscriber meanwhile: its history by replay, then the live stream.
        sub = KVEventSubscriber(ports.connect, ports.replay_connect)
        assert sub.replays == 1 and sub.resyncs == 0 and sub.last_seq == engine.last_seq
        for i in range(3):
            engine.step(big_prompt(STEPS + i))
        sub.wait_for(engine.last_seq)
        assert sub.gaps == 0
        assert_predicts(engine, sub, [big_prompt(STEPS + 2)[:40], big_prompt(0)[:40]])

        # It leaves: its queued answers are forgotten.
        hostile.close(linger=0)
        wait_until(lambda: replies.pending == 0)
    finally:
        hostile.close(linger=0)
        if sub is not None:
            sub.close()
        engine.close()


def test_a_slow_reader_still_gets_a_whole_replay_longer_than_the_bound(ports):
    engine = Engine(ports.config(buffer_steps=1000), num_blocks=1300, groups=("full",))
    slow = never_reading_client(ports.replay_connect)
    try:
        steps = 3 * REPLAY_HWM
        for i in range(steps):
            engine.step([i % 50, *range(i, i + 9)])
        time.sleep(0.1)
        slow.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.5)  # the publisher waits for it instead of dropping
        seqs = []
        while True:
            assert slow.poll(5000), f"answer stalled after {len(seqs)} batches"
            frames = slow.recv_multipart()[1:]
            if frames[0] == END_SEQ:
                break
            seqs.append(int.from_bytes(frames[0], "big"))
        assert seqs == list(range(steps))
    finally:
        slow.close(linger=0)
        engine.close()
