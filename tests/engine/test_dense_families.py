"""Mistral (a sliding window on every layer), Phi-3 (fused projections, partial rotary,
longrope) and Gemma 2 (alternating windows, soft-caps) token-exact with transformers.

Prefix caching on and off, and preemption under chunked prefill, each over two rounds
(the second must hit when caching is on); block size 4, so Mistral's window of 5 and
Gemma 2's of 7 really release blocks while requests run. The checkpoints are built in
tests/model/dense_archs.py.
"""

import pytest
import torch
from hybrid_rounds import MODES, tokens, two_rounds
from test_identical_prompts import check_lengths

from kvserve import LLM, SamplingParams
from kvserve.kvcache.specs import FullAttentionSpec, SlidingWindowSpec


def prompt(length, salt=0):
    gen = torch.Generator().manual_seed(7000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
SHARED = prompt(17, salt=1)
PROMPTS = [
    prompt(3),
    [*SHARED, *prompt(6, salt=2)],
    [*SHARED, *prompt(3, salt=3)],
    list(SHARED),
    prompt(12),
    prompt(1),
]
PREEMPT_POOL = {"mistral": 8, "phi3": 20, "gemma2": 30}
"""Blocks that make the six requests preempt one another (each pool holds one at least)."""
DENSE_MODES = {
    "cached": MODES["cached"],
    "no-cache": MODES["no-cache"],
    "preempt": {**MODES["preempt"], **MODES["chunked"]},
}


def make(ck, **kwargs):
    options = dict(block_size=4, num_kv_blocks=160, dtype="float32", device="cpu", num_threads=1)
    options.update(kwargs)
    return LLM(ck.path, **options)


@pytest.mark.parametrize("mode", list(DENSE_MODES))
@pytest.mark.parametrize("arch", ["mistral", "phi3", "gemma2"])
def test_greedy_equals_transformers(dense_checkpoints, arch, mode):
    ck = dense_checkpoints[arch]
    options = dict(DENSE_MODES[mode])
    if mode == "preempt":
        options["num_kv_blocks"] = PREEMPT_POOL[arch]
    two_rounds(make(ck, **options), ck, PROMPTS, GREEDY, mode, True)


def test_outputs_are_not_degenerate(dense_checkpoints):
    """The oracle only means something if the reference does not repeat one token."""
    for arch, ck in dense_checkpoints.items():
        assert len(set(ck.reference(PROMPTS[1], NEW))) > 5, arch


def test_window_groups_hold_only_the_window(dense_checkpoints):
    """Mistral's layers all slide (one window group); Gemma 2's alternate (two groups).
    A long decode keeps at most the window's blocks in a sliding group."""
    mistral, gemma2 = make(dense_checkpoints["mistral"]), make(dense_checkpoints["gemma2"])
    assert mistral.engine.runner.kv_cache_specs == [SlidingWindowSpec(4, 5, 2, 16, 4, 2)]
    assert gemma2.engine.runner.kv_cache_specs == [
        SlidingWindowSpec(4, 7, 2, 16, 4, 2),
        FullAttentionSpec(4, 2, 16, 4, 2),
    ]
    engine = mistral.engine
    p = prompt(9, salt=4)
    engine.add_request("long", p, GREEDY)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            held.append(sum(b != 0 for b in engine.manager.block_ids(req.request_id)[0]))
    assert 0 < max(held) <= 3  # a window of 5 over blocks of 4 spans at most 3 blocks
    out = mistral.generate([p], GREEDY, use_tqdm=False)
    assert tokens(out) == [dense_checkpoints["mistral"].reference(p, NEW)]


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_identical_prompts_are_computed_and_stored_once(dense_checkpoints, arch):
    """Invariant 7 under windows (tests/engine/test_identical_prompts.py's check): copies in
    one step, cold and cached, `n` > 1, around block boundaries and past the window."""
    ck = dense_checkpoints[arch]
    llm = LLM(ck.path, block_size=4, num_kv_blocks=400, dtype="float32", device="cpu",
              num_threads=1)  # fmt: skip
    check_lengths(llm, ck, [4, 9, 17])
