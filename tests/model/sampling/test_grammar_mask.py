"""The grammar mask: only constrained rows change, forbidden and padding columns become
-inf, and a step without constraints never imports xgrammar."""

from __future__ import annotations

import subprocess
import sys

import torch

from kvserve.batch import SeqChunk
from kvserve.kvcache.plan import StepPlan
from kvserve.model.sampling.grammar_mask import apply_grammar


class Allow:
    """A grammar row that allows exactly `ids`."""

    def __init__(self, *ids: int) -> None:
        self.ids = ids

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for i in self.ids:
            bitmask[row, i // 32] |= 1 << (i % 32) if i % 32 < 31 else -(2**31)


def chunk(grammar=None) -> SeqChunk:
    plan = StepPlan("r", ((1,),), 0, 1)
    return SeqChunk("r", [5], plan, grammar=grammar)


def test_only_constrained_rows_are_masked_padding_included():
    logits = torch.randn(3, 70)
    before = logits.clone()
    apply_grammar(logits, [chunk(), chunk(Allow(3, 31, 64)), chunk()])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept == [3, 31, 64]
    assert torch.equal(logits[1, kept], before[1, kept])


def test_the_masked_row_picks_an_allowed_token_even_when_others_are_likelier():
    logits = torch.zeros(1, 40)
    logits[0, 7] = 100.0
    apply_grammar(logits, [chunk(Allow(2, 9))])
    assert logits.argmax().item() in (2, 9)


def test_a_step_without_constraints_changes_nothing_and_loads_no_xgrammar():
    code = (
        "import sys, torch\n"
        "from kvserve.batch import SeqChunk\n"
        "from kvserve.kvcache.plan import StepPlan\n"
        "from kvserve.model.sampling.grammar_mask import apply_grammar\n"
        "logits = torch.randn(2, 8); before = logits.clone()\n"
        "plan = StepPlan('r', ((1,),), 0, 1)\n"
        "apply_grammar(logits, [SeqChunk('a', [1], plan), SeqChunk('b', [1], plan)])\n"
        "assert torch.equal(logits, before)\n"
        "print('xgrammar' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
