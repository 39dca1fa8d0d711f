"""Offline throughput: kvserve (`kvserve.LLM`) against transformers' batched `generate`.

Run: .venv/bin/python benchmarks/throughput.py [--workload random|shared-prefix|all]
         [--repeat N] [--threads 1 [2 ...]] [--hf-batch-size N] [--quick]

Both engines run the same checkpoint and the same token ids in one process, one
after the other, for every repeat (A, B, A, B, ...), so a machine shared with
other work slows both alike; the table reports the best and the median wall
time of each and the kvserve / transformers ratio of the best ones.

Checkpoint: a random Qwen3 of about 46M parameters (hidden 512, 12 layers,
8 query / 4 kv heads of 64, MLP 1536, vocabulary 16384, tied embeddings),
built by transformers from a fixed seed and saved once with `save_pretrained`
under `$XDG_CACHE_HOME/kvserve/` (or `~/.cache/kvserve/`; `--model-dir` to
choose). No hub, no network, no tokenizer: prompts are token ids. float32.

Workloads (seeded):
- `random`: 64 requests, input and output lengths uniform in [64, 512].
- `shared-prefix`: 4 groups x 16 prompts; each prompt is its group's
  1024-token prefix plus a 64-token question; 64 output tokens each.

Both engines generate exactly the requested output lengths, greedily:
kvserve with `ignore_eos=True, max_tokens=n`; transformers with
`do_sample=False, min_new_tokens = max_new_tokens`.

How transformers is driven (as a user would): prompts are left-padded and
run with its default cache (DynamicCache) and default attention (SDPA). By
default the whole workload is ONE batch (`--hf-batch-size 0`): it is what a
user with an offline list of prompts does, and the larger batch is the
faster one for `generate` here in spite of the padding (with `--quick`,
`random`, 1 thread: one batch of 16 took 9.4 s, fixed batches of 4 took
17.6 s); `--hf-batch-size N` runs fixed batches of N in workload order.
`generate` has one `max_new_tokens` per call, so in `random` (per-request
output lengths differ) each batch runs to the longest requested output of
the batch, and only the *requested* tokens of each request are counted as
output (the extra tokens are discarded work, as they would be for a user
who cuts each answer at its length). Grouping requests by output length
would be the alternative; it is not what a user does with a plain list, and
sorting the workload for one engine only would no longer compare like with
like. kvserve gets the same list in the same order and schedules it itself
(continuous batching, chunked prefill, prefix caching on).

Counted per engine: output tokens (requested), total tokens (prompt +
requested output) and wall time of the generate call(s), model load and
warm-up excluded. Before each kvserve repeat the prefix cache is reset, so
`shared-prefix` hits come only from within the run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers
from machine import machine_line

from kvserve import LLM, SamplingParams
from kvserve.model.demo import default_cache_root

MODEL_NAME = "bench-qwen3-50m-v1"
MODEL_SEED = 0
VOCAB_SIZE = 16384
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=0,
    initializer_range=0.02,
)
BLOCK_SIZE = 16
WORKLOAD_SEED = 0


@dataclass(frozen=True, slots=True)
class Item:
    prompt: list[int]
    output_len: int


# -- checkpoint -----------------------------------------------------------------


def ensure_checkpoint(model_dir: str | None) -> str:
    """The benchmark checkpoint's directory, built (atomically) on first use."""
    target = Path(model_dir) if model_dir else default_cache_root() / MODEL_NAME
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    torch.manual_seed(MODEL_SEED)
    config = transformers.Qwen3Config(**MODEL_CONFIG)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race: use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    print(f"built checkpoint {target}", file=sys.stderr)
    return str(target)


# -- workloads ------------------------------------------------------------------


def random_workload(quick: bool) -> list[Item]:
    rng = random.Random(WORKLOAD_SEED)
    n, lo, hi = (16, 16, 128) if quick else (64, 64, 512)
    items = []
    for _ in range(n):
        in_len, out_len = rng.randint(lo, hi), rng.randint(lo, hi)
        items.append(Item([rng.randrange(2, VOCAB_SIZE) for _ in range(in_len)], out_len))
    return items


def shared_prefix_workload(quick: bool) -> list[Item]:
    rng = random.Random(WORKLOAD_SEED + 1)
    groups, per_group, prefix_len, question_len, out_len = (
        (2, 8, 256, 32, 16) if quick else (4, 16, 1024, 64, 64)
    )
    items = []
    for _ in range(groups):
        prefix = [rng.randrange(2, VOCAB_SIZE) for _ in range(prefix_len)]
        for _ in range(per_group):
            question = [rng.randrange(2, VOCAB_SIZE) for _ in range(question_len)]
            items.append(Item(prefix + question, out_len))
    return items


WORKLOADS = {"random": random_workload, "shared-prefix": shared_prefix_workload}


# -- engines --------------------------------------------------------------------


def make_kvserve(model_dir: str, items: list[Item], threads: int) -> LLM:
    # Enough blocks for the whole workload at once: no preemption, as for transformers,
    # which holds the whole batch's cache too.
    blocks = sum(-(-(len(it.prompt) + it.output_len) // BLOCK_SIZE) for it in items) + 1
    return LLM(model_dir, block_size=BLOCK_SIZE, num_kv_blocks=blocks, num_threads=threads)


def run_kvserve(llm: LLM, items: list[Item]) -> tuple[float, int]:
    """(seconds, requested output tokens generated)."""
    llm.reset_prefix_cache()
    params = [
        SamplingParams(temperature=0, max_tokens=it.output_len, ignore_eos=True) for it in items
    ]
    prompts = [it.prompt for it in items]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    expected = [it.output_len for it in items]
    if produced != expected:
        raise RuntimeError("kvserve did not generate the requested lengths")
    return seconds, sum(produced)


def make_hf(model_dir: str) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def run_hf(model: transformers.PreTrainedModel, items: list[Item], batch_size: int) -> tuple:
    """(seconds, requested output tokens): each batch runs to its longest output."""
    size = batch_size or len(items)
    pad = MODEL_CONFIG["pad_token_id"]
    counted = 0
    t0 = time.perf_counter()
    for b in range(0, len(items), size):
        batch = items[b : b + size]
        width = max(len(it.prompt) for it in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, it in enumerate(batch):
            ids[row, width - len(it.prompt) :] = torch.tensor(it.prompt)
            mask[row, width - len(it.prompt) :] = 1
        new = max(it.output_len for it in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad,
            )
        if out.shape[1] != width + new:
            raise RuntimeError("transformers did not generate the requested lengths")
        counted += sum(it.output_len for it in batch)
    return time.perf_counter() - t0, counted


def warm_up(llm: LLM, hf: transformers.PreTrainedModel) -> None:
    """First calls allocate and pick kernels: keep them out of the timings."""
    rng = random.Random(12345)
    items = [Item([rng.randrange(2, VOCAB_SIZE) for _ in range(n)], 8) for n in (40, 70)]
    run_kvserve(llm, items)
    run_hf(hf, items, 0)


# -- main -----------------------------------------------------------------------


def fmt_rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per engine (default 3)")
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1],
        help="torch threads, one table row pair per value (default 1)",
    )
    ap.add_argument(
        "--hf-batch-size",
        type=int,
        default=0,
        help="transformers batch size; 0 = the whole workload as one batch (default)",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--model-dir", default=None, help="where the checkpoint is built / reused")
    args = ap.parse_args(argv)
    if args.repeat < 1 or any(t < 1 for t in args.threads):
        ap.error("--repeat and --threads must be >= 1")

    model_dir = ensure_checkpoint(args.model_dir)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    print(
        f"# {datetime.date.today()} {machine_line()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}"
    )
    print(f"# checkpoint {model_dir}: Qwen3, {_params(model_dir) / 1e6:.1f}M parameters, float32")
    hf_batch = "whole workload" if not args.hf_batch_size else str(args.hf_batch_size)
    print(f"# repeat {args.repeat}; transformers batch: {hf_batch}; kvserve block size 16")
    print()
    header = (
        "| workload | threads | engine | output tok/s | total tok/s | wall s (best) "
        "| wall s (median) | kvserve / transformers |"
    )
    print(header)
    print("|" + "---|" * 8)
    for name in names:
        items = WORKLOADS[name](args.quick)
        prompt_tokens = sum(len(it.prompt) for it in items)
        for threads in args.threads:
            torch.set_num_threads(threads)
            llm = make_kvserve(model_dir, items, threads)
            hf = make_hf(model_dir)
            warm_up(llm, hf)
            times: dict[str, list[float]] = {"kvserve": [], "transformers": []}
            output_tokens = sum(it.output_len for it in items)
            for _ in range(args.repeat):
                seconds, out = run_kvserve(llm, items)
                assert out == output_tokens
                times["kvserve"].append(seconds)
                seconds, out = run_hf(hf, items, args.hf_batch_size)
                assert out == output_tokens
                times["transformers"].append(seconds)
            best = {k: min(v) for k, v in times.items()}
            ratio = best["transformers"] / best["kvserve"]
            medians = {k: statistics.median(v) for k, v in times.items()}
            for engine in ("kvserve", "transformers"):
                t = best[engine]
                cell = f"**{ratio:.2f}x**" if engine == "kvserve" else ""
                print(
                    f"| {name} | {threads} | {engine} | {fmt_rate(output_tokens, t)} "
                    f"| {fmt_rate(prompt_tokens + output_tokens, t)} | {t:.2f} "
                    f"| {medians[engine]:.2f} | {cell} |",
                    flush=True,
                )
            del llm, hf
    print()
    print(
        f"# tok/s from the best of {args.repeat}; ratio = transformers best wall / kvserve best "
        "wall (the same for output and total tok/s: same tokens counted for both)"
    )
    return 0


def _params(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


if __name__ == "__main__":
    raise SystemExit(main())
