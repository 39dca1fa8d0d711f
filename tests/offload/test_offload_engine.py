"""The external tiers through the engine: same tokens, fewer computed, across restarts.

Each architecture runs with a device pool so small that the second round of
the same prompts finds (almost) nothing left in it: every reuse must come
from a tier, and the tokens must not change.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def prompt(length: int, salt: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(5000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


SHARED = prompt(26, salt=1)
PROMPTS = [
    [*SHARED, *prompt(7, salt=2)],
    [*SHARED, *prompt(12, salt=3)],
    prompt(30, salt=4),
    prompt(19, salt=5),
]


def make(path: str, **kwargs) -> LLM:
    options = dict(block_size=4, dtype="float32", device="cpu", num_threads=1, max_num_seqs=2)
    options.update(kwargs)
    return LLM(path, **options)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def two_rounds(llm: LLM) -> tuple[list, list]:
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # Flush the pool: unrelated prompts evict what the first round cached.
    llm.generate([prompt(40, salt=9 + i) for i in range(3)], GREEDY, use_tqdm=False)
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return first, second


def small_pool(arch: str) -> int:
    return {"bamba": 12, "gemma3": 80}.get(arch, 26)


@pytest.fixture(params=["llama", "qwen2", "qwen3", "gemma3", "bamba"])
def any_checkpoint(request, checkpoints, gemma3_checkpoint, bamba_checkpoint):
    extra = {"gemma3": gemma3_checkpoint, "bamba": bamba_checkpoint}
    return extra.get(request.param) or checkpoints[request.param]


def assert_cpu_tier_serves_what_the_pool_evicted(ck, pool: int) -> tuple[LLM, list]:
    """Both rounds equal transformers; the second loads from the tier: (the LLM, the tokens)."""
    expected = [ck.reference(p, NEW) for p in PROMPTS]
    llm = make(ck.path, num_kv_blocks=pool, offload="cpu:64MiB")
    first, second = two_rounds(llm)
    assert tokens(first) == expected
    assert tokens(second) == expected
    stats = llm.stats()
    assert stats["external_hit_tokens"] > 0
    assert stats["offload_bytes_loaded"] > 0 and stats["offload_bytes_saved"] > 0
    assert sum(o.num_cached_tokens for o in second) >= stats["external_hit_tokens"] // 2
    return llm, expected


def test_cpu_tier_serves_what_the_pool_evicted(any_checkpoint):
    ck = any_checkpoint
    llm, expected = assert_cpu_tier_serves_what_the_pool_evicted(ck, small_pool(ck.arch))
    plain = make(ck.path, num_kv_blocks=small_pool(ck.arch))
    _, p_second = two_rounds(plain)
    assert tokens(p_second) == expected
    assert llm.stats()["prefill_tokens_computed"] < plain.stats()["prefill_tokens_computed"]
    assert llm.engine.manager.pool.num_used == 0
    llm.shutdown()


def test_offload_needs_prefix_caching(checkpoints):
    with pytest.raises(ValueError, match="prefix caching"):
        make(checkpoints["qwen3"].path, offload="cpu:1MiB", enable_prefix_caching=False)


def test_malformed_offload_string_names_the_bad_part(checkpoints):
    with pytest.raises(ValueError, match="gpu"):
        make(checkpoints["qwen3"].path, offload="cpu:1MiB,gpu:3GiB")


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from kvserve import LLM, SamplingParams
    path, offload, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(path, block_size=4, dtype="float32", device="cpu", num_threads=1,
              num_kv_blocks=64, offload=offload)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    llm.shutdown()
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out],
                      "cached": [o.num_cached_tokens for o in out], "stats": llm.stats()}))
    """
)


def run_engine(path: str, offload: str, prompts: list[list[int]]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, path, offload, json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_restarted_engine_hits_what_an_earlier_process_saved(checkpoints, tmp_path):
    ck = checkpoints["qwen3"]
    offload = f"disk:{tmp_path / 'kv'}:64MiB"
    a = run_engine(ck.path, offload, PROMPTS)
    b = run_engine(ck.path, offload, PROMPTS)
    expected = [ck.reference(p, NEW) for p in PROMPTS]
    assert a["tokens"] == expected and b["tokens"] == expected
    assert a["stats"]["external_hit_tokens"] == 0
    assert b["stats"]["external_hit_tokens"] > 0
    saved = b["stats"]["external_hit_tokens"]
    assert b["stats"]["prefill_tokens_computed"] == a["stats"]["prefill_tokens_computed"] - saved
    assert sum(b["cached"]) >= saved


@pytest.mark.slow
def test_corrupt_files_are_misses_never_wrong_tokens(checkpoints, tmp_path):
    ck = checkpoints["qwen3"]
    other = checkpoints["llama"]
    kv = tmp_path / "kv"
    offload = f"disk:{kv}:64MiB"
    run_engine(ck.path, offload, PROMPTS)
    files = sorted(kv.glob("*.kvb"))
    assert len(files) >= 3
    truncated, flipped, foreign = files[0], files[1], files[2]
    truncated.write_bytes(truncated.read_bytes()[:-7])
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0xFF
    flipped.write_bytes(bytes(data))
    # A block of another model stored under one of our names.
    other_dir = tmp_path / "other"
    run_engine(other.path, f"disk:{other_dir}:64MiB", [p[:9] for p in PROMPTS])
    foreign.write_bytes(next(other_dir.glob("*.kvb")).read_bytes())
    b = run_engine(ck.path, offload, PROMPTS)
    assert b["tokens"] == [ck.reference(p, NEW) for p in PROMPTS]
    assert not truncated.exists() or truncated.stat().st_size > 0


@pytest.mark.slow
def test_two_processes_share_one_directory(checkpoints, tmp_path):
    ck = checkpoints["qwen3"]
    offload = f"disk:{tmp_path / 'kv'}:64MiB"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENGINE_SCRIPT, ck.path, offload, json.dumps(PROMPTS[i::2])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert not list(Path(tmp_path / "kv").glob("*.tmp"))
    c = run_engine(ck.path, offload, PROMPTS)
    assert c["tokens"] == [ck.reference(p, NEW) for p in PROMPTS]
    # Everything either process computed is there: all but each prompt's last block
    # (a prefix shared within this engine is a local hit of the one admitted first).
    stats = c["stats"]
    hits = stats["external_hit_tokens"] + stats["prefix_hit_tokens"]
    assert hits == sum((len(p) - 1) // 4 * 4 for p in PROMPTS)
    assert stats["external_hit_tokens"] > stats["prefix_hit_tokens"] > 0
