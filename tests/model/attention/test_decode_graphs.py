"""Decode steps through the static buffers of kvserve.model.attention.decode_graphs.

CUDA captures one graph per batch bucket over these buffers; the CPU has no graphs, so
here the same buffers, padding rows and stale table entries feed an eager forward
(`capture=False`) with the Triton kernels in their interpreter (on a CUDA machine: on
the GPU, where the interpreter is off). Greedy tokens must
equal transformers' while batches shrink (requests end at different lengths) and
prefixes hit.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.attention.decode_graphs import MAX_BATCH, DecodeGraphs, batch_buckets
from kvserve.model.memory.scratch import dummy_chunks, scratch_cache
from tests._device import exact_float32  # noqa: F401 (a fixture)
from tests.model.attention.attention_steps import BS
from tests.model.attention.backend_oracle import prompts

pytest.importorskip("triton")

EAGER_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the eager tests run: the interpreter is on only where no GPU is (tests/conftest.py)."""


def test_buckets_cover_every_batch_size_once():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]
    assert batch_buckets(10_000)[-1] == MAX_BATCH


def graphed_llm(ck, max_num_seqs: int = 8) -> tuple[LLM, list[int]]:
    """An LLM on the triton backend whose decode steps go through DecodeGraphs' buffers
    (never captured); the list records each step's rows that did."""
    llm = LLM(ck.path, block_size=BS, num_kv_blocks=96, dtype="float32", device=EAGER_DEVICE,
              num_threads=1, attention_backend="triton", max_num_seqs=max_num_seqs,
              enforce_eager=True)  # fmt: skip
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner, max_num_seqs, capture=False)
    rows: list[int] = []
    forward = graphs.forward
    graphs.forward = lambda chunks: record(forward(chunks), rows)  # type: ignore[method-assign]
    runner.decode_graphs = graphs
    return llm, rows


def check_greedy(ck, llm: LLM, rows: list[int]) -> None:
    """Requests of 3 to 9 new tokens, twice: batches of 4, 3, 2, 1 rows (padded to
    buckets 4, 4, 2, 1), the second round over cached prefixes."""
    lengths = [9, 3, 6, 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [ck.reference(p, n) for p, n in zip(prompts(), lengths, strict=True)]
    for _ in range(2):
        outputs = llm.generate(prompts(), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["prefix_hit_tokens"] > 0
    assert {4, 3, 2, 1} <= set(rows)  # every batch size went through the buffers


def test_llama_decodes_through_the_buffers_equal_transformers(llama, exact_float32):  # noqa: F811
    llm, rows = graphed_llm(llama)
    check_greedy(llama, llm, rows)


@pytest.mark.slow
def test_gemma3_windows_through_the_buffers_equal_transformers(gemma3_checkpoint, exact_float32):  # noqa: F811
    """Two KV cache groups (full and sliding window): a table buffer each."""
    llm, rows = graphed_llm(gemma3_checkpoint)
    check_greedy(gemma3_checkpoint, llm, rows)


def test_steps_a_graph_cannot_take_run_eagerly(llama):
    llm, _ = graphed_llm(llama, max_num_seqs=2)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    with torch.inference_mode():
        assert graphs.forward(dummy_chunks(runner, 3, 1, 8)) is None  # past the largest bucket
        assert graphs.forward(dummy_chunks(runner, 1, 2, 8)) is None  # a chunk of two tokens
        with scratch_cache(runner):  # another pool than the captured one
            assert graphs.forward(dummy_chunks(runner, 1, 1, 8)) is None
        assert graphs.forward(dummy_chunks(runner, 2, 1, 8)).shape == (2, 64)


def test_mamba_state_groups_are_refused(bamba_checkpoint):
    llm = LLM(bamba_checkpoint.path, block_size=BS, num_kv_blocks=96, dtype="float32",
              device=EAGER_DEVICE, num_threads=1, attention_backend="triton",
              enforce_eager=True)  # fmt: skip
    with pytest.raises(ValueError, match="decode graphs do not cover Mamba state groups"):
        DecodeGraphs(llm.engine.runner, 4, capture=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_captures_every_bucket_and_replays_them(llama, exact_float32):  # noqa: F811
    """On CUDA the runner captures a graph per bucket at start; decode steps replay them
    and greedy tokens still equal transformers'."""
    llm = LLM(llama.path, block_size=BS, num_kv_blocks=96, dtype="float32", device="cuda",
              attention_backend="triton", max_num_seqs=8)  # fmt: skip
    graphs = llm.engine.runner.decode_graphs
    assert sorted(graphs.graphs) == graphs.buckets == [1, 2, 4, 8]
    replays: list[int] = []
    for bucket, (graph, hidden) in list(graphs.graphs.items()):
        graphs.graphs[bucket] = (CountingGraph(graph, replays, bucket), hidden)
    rows: list[int] = []
    forward = graphs.forward
    graphs.forward = lambda chunks: record(forward(chunks), rows)  # type: ignore[method-assign]
    check_greedy(llama, llm, rows)
    assert {4, 2, 1} <= set(replays)
    llm.shutdown()
    assert llm.engine.runner.decode_graphs is None


class CountingGraph:
    """A captured graph that notes its bucket at each replay."""

    def __init__(self, graph, replays: list[int], bucket: int) -> None:
        self.graph, self.replays, self.bucket = graph, replays, bucket

    def replay(self) -> None:
        self.replays.append(self.bucket)
        self.graph.replay()


def record(hidden, rows: list[int]):
    if hidden is not None:
        rows.append(hidden.shape[0])
    return hidden
