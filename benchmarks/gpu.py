"""kvserve against transformers' batched `generate` on one GPU, nano-vllm's workload.

Run: .venv/bin/python benchmarks/gpu.py [--bandwidth-gbs 3350] [--engine-arg KEY=VALUE ...]
(`--help` lists the workload, device and model options).

Workload (nano-vllm's benchmark): `--num-seqs` requests, each with an input
length and an output length drawn uniformly from [--min-len, --max-len]
(seeded, `--seed`), prompts of random token ids; EOS never stops a request,
so every run generates exactly the sum of the output lengths.

Model: Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 query / 8 kv heads of
128, MLP 3072, vocabulary 151,936, tied embeddings) with random weights,
built once by transformers from a fixed seed and saved as bfloat16
safetensors under `$XDG_CACHE_HOME/kvserve/` (or `--model-dir`), so both
engines load the same file. `--layers` / `--hidden` shrink it for a smoke run
(the MLP stays 3x hidden; the heads keep their shape).

Each engine runs in a fresh worker process (its first run is the first in a
process; one engine's GPU memory is gone before the other starts), loads the
model (not timed; kvserve's warm-up at start is part of it, and its time is
printed) and runs the whole workload twice: the *first run* (kernel
selection, allocator growth, every first-call cost) and the *warm run*.

- kvserve: `LLM.generate` on the whole list (continuous batching, chunked
  prefill, prefix caching; the cache is reset before each run),
  `ignore_eos=True`; engine options are kvserve's defaults plus any
  `--engine-arg` (e.g. `num_kv_blocks=4096`). Steps and step time are the
  engine's counters (`LLM.stats()`: `steps`, prefill + decode step seconds).
- transformers: `generate` in static batches of `--batch` (64) in workload
  order, left-padded, greedy, SDPA. One call has one length, so a batch runs
  to its longest requested output (`min_new_tokens = max_new_tokens`) and
  only the requested tokens count. One batch of 256 would hold every cache
  at the longest length at once; 64 is the usual way to run `generate` over
  a list. Its steps are its forward calls.

Bound: a decode step reads every weight once, so no step takes less than
weight bytes / memory bandwidth (`--bandwidth-gbs`, default 3350 GB/s: the
H100 SXM's datasheet figure). The fraction is that minimum over the warm
run's mean step time (prefill steps included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers
from machine import machine_line

from kvserve.cli.common import positive

QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)
"""Qwen3-0.6B's config.json, the fields that shape the computation."""
MODEL_SEED = 0
DEFAULT_BANDWIDTH_GBS = 3350.0
"""NVIDIA H100 SXM5 HBM3, datasheet."""


def model_config(layers: int | None, hidden: int | None) -> dict:
    config = dict(QWEN3_06B)
    if layers:
        config["num_hidden_layers"] = layers
    if hidden:
        config["hidden_size"], config["intermediate_size"] = hidden, 3 * hidden
    return config


def ensure_checkpoint(model_dir: str | None, config: dict) -> str:
    """The random checkpoint for this shape, built (atomically) on first use."""
    from kvserve.model.demo import default_cache_root

    name = f"bench-qwen3-0.6b-shape-{config['num_hidden_layers']}x{config['hidden_size']}-v1"
    target = Path(model_dir) if model_dir else default_cache_root() / name
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"building random checkpoint {target} ...", file=sys.stderr, flush=True)
    torch.manual_seed(MODEL_SEED)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    model = model.to(torch.bfloat16).eval()
    tmp = tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        os.rename(tmp, target)
    except OSError:  # another process built it first: use that one
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return str(target)


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        in_len, out_len = rng.randint(lo, hi), rng.randint(lo, hi)
        items.append(([rng.randrange(vocab) for _ in range(in_len)], out_len))
    return items


def parse_engine_args(pairs: list[str]) -> dict:
    """`KEY=VALUE` strings as LLM keywords: ints, floats, true/false/none, else strings."""
    out: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg wants KEY=VALUE, got {pair!r}")
        lowered = text.lower()
        value: object = {"true": True, "false": False, "none": None}.get(lowered, text)
        if value is text:
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def weight_bytes(model) -> int:
    """Bytes of the distinct parameters (a tied embedding counted once): one decode step's."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _log_lines(name: str) -> list[logging.LogRecord]:
    """The records logger `name` emits from now on, at INFO and above."""
    lines: list[logging.LogRecord] = []
    handler, logger = logging.Handler(), logging.getLogger(name)
    handler.emit = lines.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return lines


def kvserve_worker(args: argparse.Namespace, model_dir: str, items: list) -> dict:
    from kvserve import LLM, SamplingParams

    # The engine's own lines: `warm-up: N shapes in X s`, `CUDA graphs: ... captured in X s`.
    warmup_log, graphs_log = (
        _log_lines("kvserve.model.memory.warmup"),
        _log_lines("kvserve.model.attention.decode_graphs"),
    )
    t0 = time.perf_counter()
    extra = parse_engine_args(args.engine_arg)
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, **extra)
    load_s = time.perf_counter() - t0
    prompts = [p for p, _ in items]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in items]
    runs = []
    for _ in range(2):
        llm.reset_prefix_cache()  # the warm run computes what the first did
        before = llm.stats()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        sync(args.device)
        seconds = time.perf_counter() - t0
        after = llm.stats()
        if [len(o.outputs[0].token_ids) for o in outputs] != [n for _, n in items]:
            raise RuntimeError("kvserve did not generate the requested lengths")
        delta = {k: after[k] - before[k] for k in ("steps", "preemptions", "generated_tokens")}
        step_s = sum(after[k] - before[k] for k in ("prefill_step_seconds", "decode_step_seconds"))
        runs.append({"seconds": seconds, "step_seconds": step_s, **delta})
    return {
        "load_s": load_s,
        "warmup_s": float(warmup_log[-1].args[1]) if warmup_log else None,
        "graphs_s": float(graphs_log[-1].args[-1]) if graphs_log else None,
        "runs": runs,
        "weight_bytes": weight_bytes(llm.engine.runner.model),
        "num_kv_blocks": llm.stats()["num_kv_blocks"],
        "threads": torch.get_num_threads(),
    }


def transformers_worker(args: argparse.Namespace, model_dir: str, items: list) -> dict:
    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(args.device).eval()
    load_s = time.perf_counter() - t0
    pad = model.config.pad_token_id
    runs = []
    for _ in range(2):
        forwards = 0
        t0 = time.perf_counter()
        for start in range(0, len(items), args.batch):
            batch = items[start : start + args.batch]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(batch):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max(n for _, n in batch)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids.to(args.device),
                    attention_mask=mask.to(args.device),
                    do_sample=False,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    pad_token_id=pad,
                )
            sync(args.device)
            if out.shape[1] != width + new:
                raise RuntimeError("transformers did not generate the requested lengths")
            forwards += new
        seconds = time.perf_counter() - t0
        runs.append({"seconds": seconds, "step_seconds": seconds, "steps": forwards})
    threads = torch.get_num_threads()
    return {"load_s": load_s, "runs": runs, "weight_bytes": weight_bytes(model), "threads": threads}


WORKERS = {"kvserve": kvserve_worker, "transformers": transformers_worker}


def run_worker(engine: str, argv: list[str]) -> dict:
    """One engine in a fresh process; its JSON result (the last line it prints)."""
    cmd = [sys.executable, __file__, *argv, "--worker", engine]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"{engine} worker failed (exit {proc.returncode}); its stderr is above")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    first, warm = result["runs"]
    print(  # a row as each engine ends: a run cut short still shows what finished
        f"{engine}: first run {first['seconds']:.1f} s, warm run {warm['seconds']:.1f} s "
        f"over {warm['steps']:,} steps",
        file=sys.stderr,
        flush=True,
    )
    return result


# -- report ---------------------------------------------------------------------


def machine(device: str, results: dict) -> str:
    if device.startswith("cuda"):
        where = f"GPU {torch.cuda.get_device_name(torch.device(device))}"
    else:
        where = f"CPU {machine_line()}"
    return (
        f"{where}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}; torch threads: "
        + ", ".join(f"{engine} {r['threads']}" for engine, r in results.items())
    )


def table(results: dict, items: list, bandwidth_gbs: float) -> list[str]:
    """The markdown rows: one per engine, ratios to transformers' warm run."""
    tokens = sum(n for _, n in items)
    lines = [
        "| engine | output tok/s (warm) | output tok/s (first run) | first-run wall s "
        "| warm wall s | first / warm | steps | mean step ms | fraction of weight-bandwidth "
        "bound | vs transformers (warm) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = results.get("transformers")
    for engine, r in results.items():
        first, warm = r["runs"]
        bound_ms = r["weight_bytes"] / (bandwidth_gbs * 1e9) * 1e3
        step_ms = warm["step_seconds"] / max(warm["steps"], 1) * 1e3
        ratio = ""
        if base is not None and engine != "transformers":
            ratio = f"**{base['runs'][1]['seconds'] / warm['seconds']:.2f}x**"
        lines.append(
            f"| {engine} | {tokens / warm['seconds']:,.0f} | {tokens / first['seconds']:,.0f} "
            f"| {first['seconds']:.2f} | {warm['seconds']:.2f} "
            f"| {first['seconds'] / warm['seconds']:.2f} | {warm['steps']:,} | {step_ms:.2f} "
            f"| {bound_ms / step_ms:.1%} | {ratio} |"
        )
    return lines


def report(args: argparse.Namespace, config: dict, items: list, results: dict) -> None:
    tokens = sum(n for _, n in items)
    prompt_tokens = sum(len(p) for p, _ in items)
    any_result = next(iter(results.values()))
    gbytes = any_result["weight_bytes"] / 1e9
    print(f"# {datetime.date.today()}  {machine(args.device, results)}")
    print(
        f"# model: Qwen3-0.6B shape ({config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, vocab {config['vocab_size']}, tied), random {args.dtype} "
        f"weights, {gbytes:.3f} GB read per decode step"
    )
    print(
        f"# workload: {len(items)} requests, input and output lengths uniform in "
        f"[{args.min_len}, {args.max_len}] (seed {args.seed}): {prompt_tokens:,} prompt "
        f"tokens, {tokens:,} output tokens, EOS ignored"
    )
    bound_ms = gbytes / args.bandwidth_gbs * 1e3
    source = " (H100 SXM's, the default)" if args.bandwidth_gbs == DEFAULT_BANDWIDTH_GBS else ""
    print(
        f"# bound: {gbytes:.3f} GB / {args.bandwidth_gbs:,.0f} GB/s{source} = {bound_ms:.3f} ms "
        "per step at the least; fraction = that / the warm run's mean step time"
    )
    extra = " ".join(args.engine_arg) or "defaults"
    print(
        f"# kvserve engine options: {extra}; transformers: static batches of {args.batch}, "
        "left-padded, greedy, SDPA, each batch to its longest output (requested tokens counted)"
    )
    print()
    for line in table(results, items, args.bandwidth_gbs):
        print(line)
    for engine, kv in results.items():
        if not engine.startswith("kvserve"):
            continue
        preempted = kv["runs"][1].get("preemptions", 0)
        warmup, graphs = kv.get("warmup_s"), kv.get("graphs_s")
        warmed = "no warm-up" if warmup is None else f"its warm-up {warmup:.1f} s"
        if graphs is not None:
            warmed += f", CUDA graph capture {graphs:.1f} s"
        print(
            f"# {engine}: load {kv['load_s']:.1f} s ({warmed}), {kv['num_kv_blocks']:,} KV "
            f"blocks, {preempted} preemptions in the warm run"
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-seqs", type=positive, default=256)
    ap.add_argument("--min-len", type=positive, default=100, help="input and output lengths")
    ap.add_argument("--max-len", type=positive, default=1024, help="input and output lengths")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch", type=positive, default=64, help="transformers' batch size")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--backends",
        default="plain,triton",
        help="kvserve attention backends to run, one row each (comma-separated; triton "
        "replays CUDA graphs for decode unless --engine-arg enforce_eager=true)",
    )
    ap.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=DEFAULT_BANDWIDTH_GBS,
        help="GPU memory bandwidth in GB/s for the bound (default: H100 SXM, 3350)",
    )
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra kvserve LLM keyword (repeat for several), e.g. num_kv_blocks=4096",
    )
    ap.add_argument("--layers", type=positive, default=None, help="smaller model: layers")
    ap.add_argument("--hidden", type=positive, default=None, help="smaller model: hidden size")
    ap.add_argument("--model-dir", default=None, help="where the checkpoint is built / reused")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.min_len > args.max_len:
        ap.error(f"--min-len {args.min_len} is above --max-len {args.max_len}")
    try:
        extra = parse_engine_args(args.engine_arg)
    except ValueError as exc:
        ap.error(str(exc))
    from kvserve.engine.engine_args import ATTENTION_BACKENDS, EngineArgs

    args.backends = [b for b in args.backends.split(",") if b]
    wrong = [b for b in args.backends if b not in ATTENTION_BACKENDS]
    if wrong or not args.backends:
        ap.error(f"--backends: each of {', '.join(ATTENTION_BACKENDS)}, got {wrong or 'none'}")
    if "attention_backend" in extra and not args.worker:
        ap.error("--engine-arg attention_backend: say it with --backends")
    unknown = sorted(set(extra) - set(EngineArgs.__dataclass_fields__))
    if unknown:  # e.g. attention_backend, on a kvserve that does not have it yet
        ap.error(f"--engine-arg: EngineArgs has no {', '.join(unknown)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA GPU (use --device cpu to smoke-test)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    config = model_config(args.layers, args.hidden)
    items = workload(args.num_seqs, args.min_len, args.max_len, config["vocab_size"], args.seed)
    model_dir = ensure_checkpoint(args.model_dir, config)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args, model_dir, items)))
        return 0
    worker_argv = [*(a for a in argv if a != "--skip-transformers"), "--model-dir", model_dir]
    runs = [(f"kvserve {b}", "kvserve", ["--engine-arg", f"attention_backend={b}"])
            for b in args.backends]  # fmt: skip
    if not args.skip_transformers:
        runs.append(("transformers", "transformers", []))
    results = {}
    for name, engine, extra_argv in runs:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run_worker(engine, [*worker_argv, *extra_argv])
    report(args, config, items, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
