"""The fuzzer's bfloat16 tie (differential.py's `other_rows_agree`) keeps the other rows'
rounding out and a wrong token in: a token far below the best of the prompt and the busy
tokens as one prefill (at the first difference or after it), or seeded logprobs off by
more than the tie, is still a finding."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve import SamplingParams
from tests._shared import shared_dir
from tests.fuzz.differential import TIE_BFLOAT16, References
from tests.fuzz.models import fuzz_checkpoints
from tests.fuzz.workloads import FuzzRequest

ARCH = "qwen2"
PROMPT = [47, 241, 136, 134, 290, 195, 86, 124, 65, 268, 84, 257, 127, 9, 118, 76]
POSITION = 3


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(fuzz_checkpoints(shared_dir(tmp_path_factory), [ARCH]), "bfloat16")


def prefill_logprobs(references: References, tokens: list[int]) -> dict[int, float]:
    """The next token's 20 best logprobs after `tokens` run as one prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    out = references.engine(ARCH).generate([tokens], params, use_tqdm=False)
    return {t: lp.logprob for t, lp in out[0].outputs[0].logprobs[0].items()}


def test_a_greedy_token_far_below_the_prefills_best_is_a_finding(references: References) -> None:
    request = FuzzRequest(PROMPT, max_tokens=POSITION + 2)
    lone = references.tokens(ARCH, request, 0)
    top = prefill_logprobs(references, PROMPT + lone[:POSITION])
    far = min(top, key=top.__getitem__)
    assert max(top.values()) - top[far] > 4 * TIE_BFLOAT16
    wrong = [*lone[:POSITION], far]
    assert not references.is_tie(ARCH, request, 0, wrong, POSITION, None)
    # and the prefill's own best token (what a several-row step gives) is one
    best = max(top, key=top.__getitem__)
    agreed = [*lone[:POSITION], best]
    assert references.other_rows_agree(ARCH, request, 0, agreed, POSITION, None)
    # a tie at the first difference does not excuse a wrong token after it
    after = prefill_logprobs(references, PROMPT + agreed)
    later = [*agreed, min(after, key=after.__getitem__)]
    assert not references.other_rows_agree(ARCH, request, 0, later, POSITION, None)


def test_seeded_logprobs_off_by_more_than_the_tie_are_a_finding(references: References) -> None:
    request = FuzzRequest(PROMPT, max_tokens=POSITION + 1, seed=5)
    lone = references.tokens(ARCH, request, 0)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=POSITION + 1, logprobs=1)
    out = references.engine(ARCH).generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    busy = out.logprobs  # the same distributions, decoded one row a step
    assert list(out.token_ids) == lone
    assert references.other_rows_agree(ARCH, request, 0, lone, POSITION, busy)
    shifted = [*busy[:-1], {t: dataclasses.replace(lp, logprob=lp.logprob + 2 * TIE_BFLOAT16)
                            for t, lp in busy[-1].items()}]  # fmt: skip
    assert not references.other_rows_agree(ARCH, request, 0, lone, POSITION, shifted)
    assert not references.is_tie(ARCH, request, 0, lone, POSITION, shifted)
