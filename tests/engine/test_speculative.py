"""Speculative decoding (prompt lookup) changes speed, never tokens, and never the cache.

Every run here drafts, accepts and rejects: the prompts repeat short cycles,
which the tiny random models tend to go on with (drafts often right), or are
random (drafts often wrong). Each run's greedy tokens must equal
transformers'; after every step the KV cache's invariants hold (slots past the
computed tokens only for drafts, never cached), and every block an event
announces holds tokens of a finished sequence: a rejected draft never reaches
a hash, an event or a tier.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.kvcache import BlockHasher, check_invariants
from kvserve.kvcache.event_sink import KVEventSink
from kvserve.kvcache.events import BlockStored

BS = 4
NEW = 20
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "disable_by_batch_size": 8}  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def random_tokens(length: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(33_000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


def cycle(salt: int, length: int = 12) -> list[int]:
    """A short cycle of random tokens repeated: tiny random models often go on with it."""
    return (random_tokens(1 + salt % 3, salt) * length)[:length]


def prompts_for(ck) -> list[list[int]]:
    """Copy-heavy prompts (repeated cycles: drafts often right), a random one (drafts
    often wrong), and one sharing the first's blocks (a prefix hit in the same run)."""
    cycles = [cycle(salt) for salt in (1, 9, 0, 4)]
    return [*cycles, random_tokens(13, 3), cycles[0][: 2 * BS] + random_tokens(5, 4)]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    """Step the engine by hand: invariants after every step, events checked. Returns the
    outputs' token ids (and counts the blocks stored in `llm.stored_blocks`)."""
    engine = llm.engine
    manager, scheduler = engine.manager, engine.scheduler
    sink = KVEventSink(BS, int_block_hashes=False)
    manager.attach_events(sink)
    finished = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    stored = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            computed = {r.request_id: r.num_computed_tokens for r in scheduler.running}
            check_invariants(manager, computed)
            stored += [e for e in sink.take() if isinstance(e, BlockStored)]
    finally:
        manager.attach_events(None)
    outputs = [finished[f"s{i}"].outputs[0].token_ids for i in range(len(prompts))]
    check_events(stored, [p + o for p, o in zip(prompts, outputs, strict=True)])
    llm.stored_blocks = getattr(llm, "stored_blocks", 0) + sum(len(e.block_hashes) for e in stored)
    return outputs


def check_events(stored: list[BlockStored], sequences: list[list[int]]) -> None:
    """Each stored block's hash and tokens are those of a block of a finished sequence."""
    hasher = BlockHasher(BS, "sha256", 0)
    known: dict[bytes, tuple[int, ...]] = {}
    for seq in sequences:
        hashes: list[bytes] = []
        hasher.extend(hashes, seq, (b"", b""))
        for i, h in enumerate(hashes):
            known[h] = tuple(seq[i * BS : (i + 1) * BS])
    for event in stored:
        for i, h in enumerate(event.block_hashes):
            assert known.get(h) == tuple(event.token_ids[i * BS : (i + 1) * BS]), (
                "an event announced a block that no finished sequence holds"
            )


def make(ck, **kwargs) -> LLM:
    options = dict(block_size=BS, num_kv_blocks=96, dtype="float32", device="cpu",
                   num_threads=1, speculative_config=SPEC)  # fmt: skip
    options.update(kwargs)
    return LLM(ck.path, **options)


def assert_drafted(llm: LLM) -> None:
    assert llm.stored_blocks > 0, "no block was cached: the event check proves nothing"
    stats = llm.engine.drafter.stats
    assert stats.num_accepted_tokens > 0, "no draft was accepted: the test proves nothing"
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "no draft was rejected"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_greedy_equals_transformers_with_hits_and_chunks(arch, checkpoints, gemma3_checkpoint):
    ck = gemma3_checkpoint if arch == "gemma3" else checkpoints[arch]
    prompts = prompts_for(ck)
    expected = [ck.reference(p, NEW) for p in prompts]
    # A step budget of 9 tokens chunks every prompt; the second round hits the first's blocks.
    llm = make(ck, max_num_batched_tokens=9, num_kv_blocks=400)
    for _ in range(2):
        assert run(llm, prompts) == expected
    assert_drafted(llm)
    assert llm.engine.manager.stats.hit_tokens > 0


def test_preemption_in_a_verified_run_and_offload(checkpoints):
    ck = checkpoints["llama"]
    prompts = prompts_for(ck)
    expected = [ck.reference(p, NEW) for p in prompts]
    llm = make(ck, num_kv_blocks=22, offload="cpu:16MiB")
    assert run(llm, prompts) == expected
    assert llm.engine.scheduler.stats.preemptions > 0
    assert_drafted(llm)
    assert llm.engine.reset_prefix_cache()
    assert run(llm, prompts) == expected  # the blocks come back from the CPU tier
    assert llm.engine.scheduler.stats.external_hit_tokens > 0


def test_drafts_stop_at_max_tokens_and_stop_tokens(checkpoints):
    ck = checkpoints["qwen3"]
    [prompt, *_] = prompts_for(ck)
    reference = ck.reference(prompt, NEW)
    llm = make(ck)
    for max_tokens in (1, 2, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert run(llm, [prompt], params) == [reference[:max_tokens]]
    stop = reference[6]
    params = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[stop])
    [out] = run(llm, [prompt], params)
    assert out == reference[: reference.index(stop) + 1]


def test_seeded_sampling_with_drafts_is_reproducible(checkpoints):
    ck = checkpoints["qwen3"]
    llm = make(ck)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=NEW, ignore_eos=True)
    first = run(llm, prompts_for(ck)[:4], params)
    assert run(llm, prompts_for(ck)[:4], params) == first  # the request's own generator
    assert all(len(out) == NEW and max(out) < 320 for out in first)
    assert llm.engine.drafter.stats.num_draft_tokens > 0


def test_hybrid_state_models_refuse_speculation(bamba_checkpoint):
    with pytest.raises(ValueError, match=r"Mamba state.*cannot be rewound"):
        make(bamba_checkpoint)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"method": "medusa"}, "Medusa heads are not supported"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "lookahead": 2}, r"unknown key.*lookahead"),
        ("{not json", "not JSON"),
    ],
)
def test_bad_configs_are_refused_before_loading(config, match):
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/model", speculative_config=config)


def test_generate_command_line_takes_the_json_and_reports_acceptance(checkpoints, capsys):
    ck = checkpoints["qwen3"]
    prompt = json.dumps(cycle(0))
    argv = ["generate", "--model", ck.path, "--prompt-token-ids", prompt, "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos", "--no-progress", "--num-threads", "1",
            "--num-kv-blocks", "32", "--block-size", "4", "--dtype", "float32",
            "--speculative-config", json.dumps(SPEC)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    accepted, drafted = out.split("speculative: ")[1].split(" draft tokens")[0].split(" of ")
    assert 0 < int(accepted) <= int(drafted)
    assert main([*argv[:-1], '{"method": "eagle"}']) == 2
    assert "EAGLE heads are not supported" in capsys.readouterr().err
