"""Faults in a KV transfer, each under load (several requests at once): nothing is lost,
nothing is wrong, nothing leaks. Real engines on loopback; the faults on the wire come
from a man in the middle (_tamper.py) between the consumer and a real producer:

- the producer gone mid-transfer (its answers stop): the asks already answered are used,
  the rest is recomputed after one timeout (Llama, Gemma 3's sliding windows, Bamba's
  Mamba2 states);
- a payload's bytes flipped, or cut short: that block fails its checksum and is
  recomputed with what follows it, the blocks before it are used (also with sliding
  windows, Gemma 3, and Mamba2 states, Bamba);
- an answer that lost frames, or with a frame larger than any block (refused unread):
  the whole ask is a miss, recomputed;
- the producer's kept blocks reclaimed by memory pressure before the pull (a CPU tier
  smaller than the prompts' blocks: the oldest hold gives way), also while it keeps
  prefilling as the consumer pulls (Llama, Gemma 3, Bamba);
- a producer slow to answer: the consumer's running requests go on generating meanwhile
  (the pull runs off the engine thread), the waiting one is admitted when its blocks come.

Every time: the consumer's greedy tokens equal transformers' (a lone engine's), and
both engines' pools end with every block free and the manager's invariants holding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import RequestOutputKind
from tests.transfer._engines import (
    BS,
    NEW,
    PROMPTS,
    RUN,
    assert_no_leak,
    consumer_engine,
    cpu_tier,
    endpoint,
    kept,
    producer_engine,
    remote,
    run,
    stored_per_prompt,
)
from tests.transfer._tamper import Tamper


def flip(block: int):
    def edit(n: int, frames: list[bytes]) -> list[bytes]:
        data = bytearray(frames[1 + block])
        data[len(data) // 2] ^= 0x40
        return [*frames[: 1 + block], bytes(data), *frames[2 + block :]]

    return edit


def shorten(block: int):
    def edit(n: int, frames: list[bytes]) -> list[bytes]:
        return [*frames[: 1 + block], frames[1 + block][:-7], *frames[2 + block :]]

    return edit


def transfer(ck, edit, prompts=PROMPTS):
    """Prefill `prompts` on a producer, decode them on a consumer through `edit`: the
    consumer's tokens, its stats and its remote tier's counters."""
    producer = producer_engine(ck)
    tamper = Tamper(endpoint(producer), edit)
    consumer = consumer_engine(ck, tamper.endpoint)
    try:
        run(producer, prompts, 1)
        got = run(consumer, prompts)
        assert got == [ck.reference(p, NEW) for p in prompts]
        assert_no_leak(producer, consumer)
        return consumer.stats(), remote(consumer), tamper
    finally:
        consumer.shutdown()
        tamper.close()
        producer.shutdown()


@pytest.mark.parametrize("fault", ["flipped", "shortened"])
def test_a_corrupt_block_recomputes_itself_and_what_follows_only(checkpoints, fault):
    bad = 3  # every answer's fourth block
    edit = (flip if fault == "flipped" else shorten)(bad)
    stats, tier, tamper = transfer(checkpoints["llama"], edit)
    # Each request pulled the blocks before the bad one, in one answer each.
    assert tier.rejected == tamper.gets >= len(PROMPTS)
    assert stats["external_hit_tokens"] == len(PROMPTS) * bad * BS
    assert tier.failures == 0


@pytest.mark.parametrize("arch", ["gemma3", "bamba"])
def test_a_corrupt_block_of_a_window_or_state_model_is_recomputed(
    arch, gemma3_checkpoint, bamba_checkpoint
):
    ck = gemma3_checkpoint if arch == "gemma3" else bamba_checkpoint
    stats, tier, tamper = transfer(ck, flip(1))  # a block every answer holds
    assert tier.rejected == tamper.gets >= len(PROMPTS) and tier.failures == 0
    assert stats["external_hit_tokens"] < len(PROMPTS) * RUN * BS  # the hit ends before it


def test_an_answer_that_lost_frames_is_a_miss(checkpoints):
    stats, tier, tamper = transfer(checkpoints["llama"], lambda n, frames: frames[:-1])
    assert tamper.gets == 1 and tier.failures == 1  # then the producer rests (back-off)
    assert stats["external_hit_tokens"] == 0 and tier.blocks_received == 0


def test_a_frame_larger_than_any_block_is_refused_unread(checkpoints):
    def inflate(n: int, frames: list[bytes]) -> list[bytes]:
        return [frames[0], frames[1] + bytes(1 << 20), *frames[2:]]  # a block is KiBs

    stats, tier, _ = transfer(checkpoints["llama"], inflate)
    # ZMQ dropped the connection at the frame's size: a failed ask, not a checksum.
    assert tier.failures == 1 and tier.rejected == 0
    assert stats["external_hit_tokens"] == 0


def model(arch: str, request) -> Any:
    """The tiny checkpoint of `arch`: Llama, Gemma 3 (sliding windows), Bamba (Mamba2)."""
    if arch == "llama":
        return request.getfixturevalue("checkpoints")["llama"]
    return request.getfixturevalue(f"{arch}_checkpoint")


def blocks_per_run(arch: str) -> int:
    """Keys a consumer pulls for one prompt's whole run: RUN blocks of each attention group
    (Gemma 3's six: its sliding windows reach past these prompts), one state per Mamba
    group (Bamba's three, beside one attention group)."""
    return {"llama": RUN, "gemma3": 6 * RUN, "bamba": RUN + 3}[arch]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "bamba"])
def test_a_producer_gone_mid_transfer_costs_one_timeout(arch, request):
    answered = 2

    def die(n: int, frames: list[bytes]) -> list[bytes] | None:
        return frames if n < answered else None

    stats, tier, tamper = transfer(model(arch, request), die)
    assert tamper.dead.is_set() and tier.failures == 1
    # The requests whose blocks came before it died used them (every attention block of
    # the run, each state where it ends); the others recomputed.
    assert stats["external_hit_tokens"] == answered * RUN * BS
    assert tier.blocks_received == answered * blocks_per_run(arch)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "bamba"])
def test_kept_blocks_reclaimed_under_pressure_are_recomputed(arch, request):
    """More prompts than the producer's CPU tier keeps: its kept blocks are reclaimed, the
    oldest hold first, before their pull (then the holds left end, 1 s here, and the tier
    ends keeping nothing)."""
    ck = model(arch, request)
    one = stored_per_prompt(ck)
    room = one + one // 5  # the last prompt's blocks and the tail of the one before
    producer = producer_engine(ck, f"cpu:{room}", hold_seconds=1)
    consumer = consumer_engine(ck, endpoint(producer))
    try:
        run(producer, PROMPTS, 1)
        assert kept(producer)["released_by_pressure"] > 0
        assert run(consumer, PROMPTS) == [ck.reference(p, NEW) for p in PROMPTS]
        # Only the last prompt's run was still whole: the others begin with evicted blocks.
        assert consumer.stats()["external_hit_tokens"] == RUN * BS
        assert_no_leak(producer, consumer)

        # Under load on both sides: the producer prefills (and reclaims) while the
        # consumer pulls; whatever each lookup finds, the tokens are right.
        more = [[7 + (13 * i + j) % 230 for j in range(40)] for i in range(8)]
        run(producer, more[:4], 1)
        busy = threading.Thread(target=run, args=(producer, more[4:], 2))
        busy.start()
        got = run(consumer, more)
        busy.join()
        assert got == [ck.reference(p, NEW) for p in more]
        assert_no_leak(producer, consumer)
        assert cpu_tier(producer).used_bytes <= room
        deadline = time.monotonic() + 30  # liveness: the 1 s holds end
        while kept(producer)["blocks"] and time.monotonic() < deadline:
            time.sleep(0.2)
        # Nothing kept is left (which of pull, pressure or deadline ended each hold depends
        # on the timing; test_transfer_holds.py pins each alone).
        assert kept(producer)["blocks"] == 0
    finally:
        consumer.shutdown()
        producer.shutdown()


@contextmanager
def held_answers(ck) -> Iterator[tuple[LLM, LLM, threading.Event]]:
    """A producer whose answers wait (through a Tamper) until the test sets the gate, and a
    consumer that waits for them up to a minute: (producer, consumer, gate). All closed
    after, the gate opened first."""
    gate = threading.Event()
    producer = producer_engine(ck)
    tamper = Tamper(endpoint(producer), lambda n, frames: frames if gate.wait(60) else None)
    consumer = consumer_engine(ck, tamper.endpoint, timeout_s=60)
    try:
        yield producer, consumer, gate
    finally:
        gate.set()
        consumer.shutdown()
        tamper.close()
        producer.shutdown()


def test_a_slow_producer_never_stalls_the_consumer_running_requests(checkpoints):
    ck = checkpoints["llama"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    done: dict[str, list[int]] = {}
    with held_answers(ck) as (producer, consumer, gate):
        engine = consumer.engine

        def step() -> None:
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.outputs[0].token_ids

        run(producer, PROMPTS[:1], 1)
        engine.add_request("running", PROMPTS[1], params)  # the producer lacks its blocks
        while not engine.scheduler.running:
            step()
        engine.add_request("pulling", PROMPTS[0], params)  # its blocks wait behind the gate
        before = engine.scheduler.running[0].num_computed_tokens
        for _ in range(8):
            step()
        assert [r.request_id for r in engine.scheduler.waiting] == ["pulling"]
        assert engine.scheduler.running[0].num_computed_tokens == before + 8
        gate.set()
        while engine.has_unfinished_requests():
            step()
        assert done == {"running": ck.reference(PROMPTS[1], 24),
                        "pulling": ck.reference(PROMPTS[0], 24)}  # fmt: skip
        assert consumer.stats()["external_hit_tokens"] == RUN * BS  # pulled, not recomputed
        assert_no_leak(producer, consumer)


def test_a_request_aborted_while_its_blocks_are_on_their_way_leaves_nothing(checkpoints):
    ck = checkpoints["llama"]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    with held_answers(ck) as (producer, consumer, gate):
        engine = consumer.engine
        run(producer, PROMPTS[:1], 1)
        engine.add_request("leaving", PROMPTS[0], params)
        engine.step()  # its lookup waits for the producer
        assert engine.scheduler.waiting and not engine.scheduler.running
        engine.abort_request("leaving")  # its client left
        assert not engine.has_unfinished_requests()
        gate.set()  # the answer still comes, for nobody
        assert run(consumer, PROMPTS[:1]) == [ck.reference(PROMPTS[0], NEW)]
        assert consumer.stats()["external_hit_tokens"] == RUN * BS  # pulled again, whole
        assert not engine.connector._staged and not engine.connector.fetches._futures
        assert_no_leak(producer, consumer)
