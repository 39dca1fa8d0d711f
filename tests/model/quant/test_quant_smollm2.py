"""What quantization costs on the real default model (SmolLM2-135M-Instruct, Q4_1).

The reference is the float32 model (the file's weights, dequantized). Each
mode reads the same 602-token English text teacher-forced, in one step:

- top-1 agreement: the fraction of positions whose most likely next token
  is float32's. A 135M model is unsure at many positions (a quarter of them
  have two tokens within 0.33 logits of each other), where any rounding may
  swap the two: bfloat16 alone agrees at 97 %. So the test also asks for
  agreement at the positions float32 is sure of (top-1 at least 0.5 logits
  above the next), which must be nearly total;
- perplexity of the text, within 3 % (int8) or 10 % (int4, gguf) of float32's;
- the greedy answer to "What is the capital of France?" names Paris (QUESTION).

The text is one step of 602 rows: the packed layers' prefill path (float
activations times the dequantized weights; on a CPU with AMX, the tiles'
bfloat16 activations times the weights in bfloat16). The gguf tests also run it
with every row through the integer kernel (int8 activations), what a decode step
computes. Measured (Intel Xeon, AVX-512 VNNI, torch 2.13), prefill / integer
kernel: top-1 int8 94.0 / 93.9 %, int4 96.4 / 94.4 %, gguf 96.2 / 95.2 %; at
the sure positions 100 % for all; perplexity +0.1 / +0.5 %, -0.0 / +0.2 %,
-0.0 / +0.5 %. With bfloat16 activations (`dtype="bfloat16"`) gguf agrees at
95.5 / 94.0 %, 100 % where sure, perplexity -0.1 %. The prefill path on AMX
tiles (the same Xeon): int8 93.5 %, int4 95.9 %, gguf 95.9 % (95.2 % with
bfloat16 activations), 100 % where sure, perplexity +0.3 %, -0.1 %, -0.1 %
(+0.1 %).
int8 stays below int4 here because the file's weights are Q4_1 blocks: int4
with groups of 32 finds the same blocks again, while one int8 scale per row
cannot hold 32-column blocks of different scales (with float32 kernels int8
still agrees at only 96 %, int4 at 100 %).

int8 and int4 pack a copy of the float32 model (`quantize_model`, what the
loader runs after loading), sharing one load; gguf loads the file itself.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.quant import quant_linear
from kvserve.model.quant.quant_linear import Int4Linear, Int8Linear
from kvserve.model.quant.quantize import quantize_model
from tests.model.quant.teacher_forcing import TEXT, perplexity, teacher_forced_logits
from tests.model.smollm2 import PATH, needs_smollm2

pytestmark = [needs_smollm2, pytest.mark.slow]

SURE_MARGIN = 0.5
"""Logits between float32's top-1 and top-2 above which a position counts as sure."""
LIMITS = {  # mode: (top-1 agreement, agreement where sure, perplexity increase)
    "int8": (0.90, 0.99, 0.03),
    "int4": (0.90, 0.99, 0.10),
    "gguf": (0.90, 0.99, 0.10),
}
QUESTION = [
    {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]
"""Asked alone, the question is a coin flip even for float32: its first token "The" (then
"capital of France is Paris.") leads "L" (then "'Étoile, la Marseillaise, ...") by 0.08
logits. With this system prompt float32 leads by 1.3 logits, a margin rounding cannot
undo; the answer still has to come out right in each mode."""


def engine_kwargs(**kwargs):
    return dict(block_size=16, num_kv_blocks=64, dtype="float32", num_threads=1, **kwargs)


@pytest.fixture(scope="module")
def float32() -> LLM:
    return LLM(str(PATH), **engine_kwargs())


@pytest.fixture(scope="module")
def text_ids(float32) -> list[int]:
    ids = float32.get_tokenizer()(TEXT, add_special_tokens=False).input_ids
    assert len(ids) >= 512
    return ids


@pytest.fixture(scope="module")
def reference(float32, text_ids) -> torch.Tensor:
    return teacher_forced_logits(float32.engine.runner, text_ids, float32.engine.runner.model)


@pytest.fixture(scope="module")
def gguf() -> LLM:
    return LLM(str(PATH), **engine_kwargs(quantization="gguf"))


def answer(llm: LLM) -> str:
    llm.reset_prefix_cache()  # blocks cached under another model hold its K/V
    out = llm.chat([QUESTION], SamplingParams(temperature=0, max_tokens=16))
    return out[0].outputs[0].text


def assert_accuracy(mode, logits, reference, text_ids):
    top1 = logits.argmax(-1) == reference.argmax(-1)
    best = reference.topk(2, dim=-1).values
    sure = best[:, 0] - best[:, 1] >= SURE_MARGIN
    assert sure.sum() > len(text_ids) / 2  # most positions: the second test has weight
    ratio = perplexity(logits, text_ids) / perplexity(reference, text_ids) - 1
    agreement, sure_agreement, ppl = LIMITS[mode]
    measured = (top1.float().mean().item(), top1[sure].float().mean().item(), ratio)
    assert measured[0] >= agreement and measured[1] >= sure_agreement, (mode, measured)
    assert abs(ratio) <= ppl, (mode, measured)
    assert measured[0] < 1, "identical to float32: nothing was quantized"


def both_paths(runner, text_ids: list[int]) -> list[torch.Tensor]:
    """The text's logits through the prefill path (AMX tiles where the CPU has them, else
    the dense matmul), then with every row on the integer kernel (the rows of a decode
    step), which must round differently."""
    prefill = teacher_forced_logits(runner, text_ids, runner.model)
    kernel = quant_matmul.kernel()
    assert kernel is not None
    tiles, never = kernel.tile_rows, {torch.bfloat16: 10**9, torch.float32: 10**9}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quant_linear, "DENSE_ROWS", never)
        patch.setattr(quant_linear, "DENSE_ROWS_ON_TILES", never)
        kernel.use_tiles(False)
        try:
            integer = teacher_forced_logits(runner, text_ids, runner.model)
        finally:
            kernel.use_tiles(tiles > 0)
    assert not torch.equal(prefill, integer)
    return [prefill, integer]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_packed_copy_of_float32(float32, text_ids, reference, mode):
    runner = float32.engine.runner
    model = copy.deepcopy(runner.model)
    quantize_model(model, mode)
    kind = Int4Linear if mode == "int4" else Int8Linear
    assert isinstance(model.model.layers[29].mlp.down_proj, kind)
    assert isinstance(model.lm_head, Int8Linear)  # tied: a packed copy of the embeddings
    assert_accuracy(mode, teacher_forced_logits(runner, text_ids, model), reference, text_ids)
    float_model, runner.model = runner.model, model
    try:
        assert "Paris" in answer(float32)
    finally:
        runner.model = float_model
        float32.reset_prefix_cache()


def test_gguf_keeps_the_files_blocks(gguf, text_ids, reference):
    runner = gguf.engine.runner
    layers = [m for m in runner.model.model.layers.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * 30  # every projection's Q4_1 blocks, as they are (q/k/v and
    # gate/up stacked)
    assert isinstance(runner.model.lm_head, Int8Linear)  # from the Q8_0 embeddings
    for logits in both_paths(runner, text_ids):
        assert_accuracy("gguf", logits, reference, text_ids)
    assert "Paris" in answer(gguf)


def test_gguf_blocks_with_bfloat16_activations(text_ids, reference):
    """The fastest mode one request at a time (benchmarks/README.md, cpu_real): the file's
    blocks, bfloat16 activations, attention and KV cache; judged as the modes above."""
    llm = LLM(str(PATH), **{**engine_kwargs(quantization="gguf"), "dtype": "bfloat16"})
    runner = llm.engine.runner
    assert runner.dtype == torch.bfloat16
    for logits in both_paths(runner, text_ids):
        assert_accuracy("gguf", logits.float(), reference, text_ids)
    assert "Paris" in answer(llm)


def test_float32_answers_paris_too(float32):
    """The reference itself: its answer, and that the swaps above left it in place."""
    assert isinstance(float32.engine.runner.model.model.layers[0].mlp.gate_up_proj, torch.nn.Linear)
    assert "Paris" in answer(float32)
