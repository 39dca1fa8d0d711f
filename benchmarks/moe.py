"""A mixture-of-experts model against a dense one with the same active parameters, on the CPU.

Run: .venv/bin/python benchmarks/moe.py [--threads 1] [--steps 24] [--repeat 3]
         [--quantizations none int4] [--batches 1 16]

Models (random weights, built with transformers and saved once under --dir):
- moe: Qwen3-MoE with Qwen3-30B-A3B's shape ratios scaled by 1/4 in width
  (hidden 2048 -> 512, expert width 768 -> 192, 32 query heads over 4 kv
  heads -> 8 over 1, head_dim 128 -> 64), all 128 experts and 8 per token,
  4 layers instead of 48, a vocabulary of 8192: 151M expert parameters, 9.4M
  of them active per token.
- dense: Qwen3 with the same attention and an MLP of 8 x 192 = 1536: the
  MoE's active parameters (less the router's 128 x 512 per layer).

Workload: `batch` requests of 16 prompt tokens decode `--steps` tokens
each, greedy; the prefill steps are not timed. Each decode step is timed by
wall clock and by the process's CPU time (the machine is shared: CPU time is
what the step cost this process). The table reports the median per step over
the repeats' steps, decode tokens/s (batch / median wall step), and the MoE's
step time as a multiple of the dense model's at the same batch and mode, by
wall clock and by CPU time (target: at most 1.5 at batch 1).

llama.cpp is not compared: llama-cpp-python installs by a source build (~10
minutes on two cores, see benchmarks/cpu_real.py), and kvserve's tiny random
MoE would first have to be written as a GGUF file.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from machine import load, machine_line

PROMPT_TOKENS = 16
SHAPE = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=64,
    num_hidden_layers=4,
    vocab_size=8192,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
EXPERTS, TOP_K, EXPERT_WIDTH = 128, 8, 192


def build(kind: str, root: Path) -> Path:
    """The checkpoint of `kind` (moe or dense), saved once."""
    import transformers

    path = root / f"bench-{kind}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    if kind == "moe":
        config = transformers.Qwen3MoeConfig(
            **SHAPE, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH, intermediate_size=TOP_K * EXPERT_WIDTH,
            norm_topk_prob=True,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_WIDTH)
        model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    return path


def decode_steps(path: Path, batch: int, steps: int, threads: int, quantization: str):
    """[(wall s, cpu s)] of each decode step of `batch` requests."""
    from kvserve import LLM, SamplingParams

    llm = LLM(
        str(path), dtype="float32", num_threads=threads, quantization=quantization,
        block_size=16, num_kv_blocks=batch * ((PROMPT_TOKENS + steps) // 16 + 2) + 4,
        max_num_seqs=batch,
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(3, 8000, (PROMPT_TOKENS,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # the prefills (one step: 16 x 16 tokens fit the default budget)
    times = []
    while engine.has_unfinished_requests():
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    llm.shutdown()
    return times[1:]  # the first decode step warms the allocator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--quantizations", nargs="+", default=["none", "int4"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kvserve-bench-moe"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: build(kind, args.dir) for kind in ("dense", "moe")}
    print(f"machine: {machine_line(args.threads)} at start, torch {torch.__version__}")
    print(
        f"moe: {EXPERTS} experts, {TOP_K} per token, width {EXPERT_WIDTH}; dense MLP "
        f"{TOP_K * EXPERT_WIDTH}; {args.steps} decode steps x {args.repeat} repeats\n"
    )
    header = f"{'model':6} {'quant':5} {'batch':>5} {'step ms':>8} {'cpu ms':>8} {'tok/s':>8}"
    print(f"{header} {'moe/dense (wall)':>16} {'moe/dense (cpu)':>15}")
    for quantization in args.quantizations:
        for batch in args.batches:
            medians: dict[str, tuple[float, float]] = {}
            for kind, path in paths.items():
                times = []
                for _ in range(args.repeat):
                    times += decode_steps(path, batch, args.steps, args.threads, quantization)
                wall = statistics.median(t for t, _ in times)
                cpu = statistics.median(c for _, c in times)
                medians[kind] = (wall, cpu)
                ratios = ""
                if kind == "moe":
                    dense_wall, dense_cpu = medians["dense"]
                    ratios = f"{wall / dense_wall:16.2f} {cpu / dense_cpu:15.2f}"
                print(
                    f"{kind:6} {quantization:5} {batch:5d} {wall * 1e3:8.2f} {cpu * 1e3:8.2f} "
                    f"{batch / wall:8.1f} {ratios}",
                    flush=True,
                )
    print(f"\nload average {load()} at the end")


if __name__ == "__main__":
    main()
