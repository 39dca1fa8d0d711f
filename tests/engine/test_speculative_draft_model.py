"""Speculative decoding with a draft model: the same greedy tokens, and the draft's own K/V
right wherever the target's is (prefix hits, chunked prefill, preemption).

The drafts come from a 1-layer model cut from the target (its first layer,
embeddings, norm and head: often right on the repeated cycles, often
wrong elsewhere), and from the target itself: a draft equal to the target
must propose exactly the target's tokens, so every draft is accepted unless
the draft's K/V is wrong somewhere (a hit block without it, a lookahead
slot left unwritten, a copy it missed).
"""

from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.model_free_runner import ModelFreeRunner
from tests._shared import saved_once, shared_dir
from tests.conftest import ARCHS, COMMON, Checkpoint
from tests.engine.test_speculative import NEW, assert_drafted, cycle, make, prompts_for, run

DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": 8}


def cut_draft(tmp_path_factory, ck: Checkpoint, **overrides) -> str:
    """A 1-layer model of `ck`'s family holding its first layer, embeddings, norm and head
    (`overrides` change its config: another vocabulary), saved once per run."""
    config_cls, model_cls, extra, _ = ARCHS[ck.arch]
    config = config_cls(**{**COMMON, **extra, "num_hidden_layers": 1, **overrides})
    name = "-".join(f"{k}{v}" for k, v in overrides.items())
    path = shared_dir(tmp_path_factory) / f"draft-{ck.arch}{name}"

    def build():
        model = model_cls(config).eval()
        if not overrides:
            model.load_state_dict(ck.hf_model.state_dict(), strict=False)  # layers 1+ left out
        return model

    saved_once(path, build, lambda saved: None)
    return str(path)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, checkpoints) -> dict[str, str]:
    return {arch: cut_draft(tmp_path_factory, checkpoints[arch]) for arch in ("llama", "qwen3")}


def spec(model: str) -> dict:
    return {**DRAFT, "model": model}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_transformers_with_hits_and_chunks(arch, checkpoints, drafts):
    ck = checkpoints[arch]
    prompts = prompts_for(ck)
    expected = [ck.reference(p, NEW) for p in prompts]
    # A step budget of 9 tokens chunks every prompt; the second round hits the first's blocks.
    llm = make(
        ck, max_num_batched_tokens=9, num_kv_blocks=400, speculative_config=spec(drafts[arch])
    )
    for _ in range(2):
        assert run(llm, prompts) == expected
    assert_drafted(llm)
    assert llm.engine.manager.stats.hit_tokens > 0


def test_preemption_in_a_verified_run(checkpoints, drafts):
    ck = checkpoints["llama"]
    prompts = prompts_for(ck)
    expected = [ck.reference(p, NEW) for p in prompts]
    llm = make(ck, num_kv_blocks=22, speculative_config=spec(drafts["llama"]))
    assert run(llm, prompts) == expected
    assert llm.engine.scheduler.stats.preemptions > 0
    assert_drafted(llm)


def test_seeded_sampling_with_a_draft_model_is_reproducible(checkpoints, drafts):
    ck = checkpoints["qwen3"]
    llm = make(ck, speculative_config=spec(drafts["qwen3"]))
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=NEW, ignore_eos=True)
    first = run(llm, prompts_for(ck)[:4], params)
    assert run(llm, prompts_for(ck)[:4], params) == first  # the request's own generator
    assert all(len(out) == NEW and max(out) < 320 for out in first)
    assert llm.engine.drafter.stats.num_draft_tokens > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_target_as_its_own_draft_accepts_every_draft(arch, checkpoints, gemma3_checkpoint):
    """Hits, chunks (gemma3) and preemptions (llama): a draft K/V missing anywhere would
    show as a rejected draft."""
    ck = gemma3_checkpoint if arch == "gemma3" else checkpoints[arch]
    prompts = prompts_for(ck)
    expected = [ck.reference(p, NEW) for p in prompts]
    # Gemma 3: chunks of a 9-token budget; Llama: a pool small enough to preempt.
    pool = dict(max_num_batched_tokens=9, num_kv_blocks=400) if arch == "gemma3" else {}
    llm = make(ck, **{"num_kv_blocks": 22, **pool}, speculative_config=spec(ck.path))
    for _ in range(2):
        assert run(llm, prompts) == expected
    stats = llm.engine.drafter.stats
    assert stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.manager.stats.hit_tokens > 0
    if arch == "llama":
        assert llm.engine.scheduler.stats.preemptions > 0


def test_bad_draft_models_are_refused(tmp_path_factory, checkpoints, bamba_checkpoint, drafts):
    ck = checkpoints["llama"]
    other_vocab = cut_draft(tmp_path_factory, ck, vocab_size=256)
    with pytest.raises(ValueError, match=r"vocabulary has 256 tokens, the target's 320"):
        make(ck, speculative_config=spec(other_vocab))
    with pytest.raises(ValueError, match=r"Mamba state.*cannot be rewound"):
        make(bamba_checkpoint, speculative_config=spec(drafts["llama"]))
    with pytest.raises(ValueError, match=r"draft model keeps Mamba state"):
        make(ck, speculative_config=spec(bamba_checkpoint.path))
    args = EngineArgs(block_size=4, speculative_config=spec(ck.path))
    with pytest.raises(ValueError, match=r"needs a model runner.*ModelFreeRunner"):
        LLMEngine.from_runner(ModelFreeRunner(num_blocks=64, hash_block_size=4), args)


@pytest.mark.parametrize(
    ("config", "extra", "match"),
    [
        ({"method": "draft_model"}, {}, r"'draft_model' needs 'model'"),
        ({"method": "ngram", "model": "x"}, {}, r"'model' is read by method 'draft_model' only"),
        ({"model": "x"}, {"offload": "cpu:1GiB"}, r"'draft_model' with offload tiers"),
    ],
)
def test_bad_draft_configs_are_refused_before_loading(config, extra, match):
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/model", speculative_config=config, **extra)


def test_generate_command_line_takes_a_draft_model(checkpoints, drafts, capsys):
    ck = checkpoints["qwen3"]
    argv = ["generate", "--model", ck.path, "--prompt-token-ids", json.dumps(cycle(0)),
            "--max-tokens", "12", "--temperature", "0", "--ignore-eos", "--no-progress",
            "--num-threads", "1", "--num-kv-blocks", "32", "--block-size", "4",
            "--dtype", "float32",
            "--speculative-config", json.dumps(spec(drafts["qwen3"]))]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    accepted, drafted = out.split("speculative: ")[1].split(" draft tokens")[0].split(" of ")
    assert 0 < int(accepted) <= int(drafted)


def test_the_pool_counts_the_drafts_share_of_each_block(checkpoints, drafts):
    ck = checkpoints["llama"]
    plain = make(ck, num_kv_blocks=None, kv_cache_memory="1MiB", speculative_config=None)
    llm = make(ck, num_kv_blocks=None, kv_cache_memory="1MiB", speculative_config=spec(ck.path))
    runner = llm.engine.runner
    assert runner.bytes_per_block == 2 * plain.engine.runner.bytes_per_block  # draft == target
    assert runner.num_blocks == 2**20 // runner.bytes_per_block
    assert all(k.shape[0] == runner.num_blocks for k, _ in runner.draft.kv_caches)
