"""A 1B-parameter model on the CPU: kvserve against llama.cpp, vLLM's CPU build and memory.

Run: .venv/bin/python benchmarks/llama_1b.py [--threads 2] [--repeat 2] [--rounds 2] [--prompts 4]
         [--tokens 32] [--one-at-a-time gguf gguf/vnni gguf+bf16 bfloat16]
         [--batched bfloat16 float32]
         [--skip-llama-cpp] [--eager]

Why: decode reads every weight once a step, so on a 0.5-3B model the speed of one request
is the speed of reading the weights; the default model (135M) hides that. The model is
llama_1b_weights.py's random 1B Llama (written once, a few minutes): the same tensors as
a bfloat16 HF directory and as a Q4_0 GGUF file.

Tables (greedy, EOS ignored, so every run makes exactly the tokens asked for; the same
token ids for every engine, from the default model's tokenizer and chat template):

1. **One request at a time**: `--prompts` chats one after the other, `--tokens` each.
   llama.cpp (`llama-cpp-python`, Q4_0 as it is) against kvserve on the same GGUF file
   (`quantization="gguf"`: the Q4_0 blocks on kvserve's packed kernel, float32 or
   bfloat16 activations) and on the HF directory. Also the memory bound: a row's weight
   bytes read per token over the copy bandwidth measured here (torch `copy_` of 1 GiB
   with the same threads, STREAM's convention: bytes read plus written; the faster of a
   copy between torch's allocations and one between buffers on 2 MiB pages, where
   kvserve keeps its weights), measured again before every run, as a virtual machine's
   moves from minute to minute; the Q4_0 rows are held to the file's bytes (kvserve's
   packing reads a few more).
2. **Batched**: the same chats all at once through each engine's offline `LLM.generate`,
   kvserve against vLLM's CPU build on the HF directory (cpu_vs_vllm.py's workers and its
   set-up: vLLM from its own environment, both with Intel's OpenMP preloaded).

Each row runs in a fresh process (thread settings are process-wide) after a warm-up,
`--rounds` times, in opposite orders each round; the table has the median and best of all
its runs. llama.cpp is a benchmark-only
dependency (`.venv/bin/pip install llama-cpp-python diskcache`, which compiles for about
ten minutes on two cores), vLLM's environment is cpu_vs_vllm.py's; rows whose engine is
missing are skipped, and the script says so. On a CPU with AMX, llama.cpp's AMX kernels
may crash at the first matmul (SIGSEGV in `ggml_backend_amx_mul_mat`, seen on a virtual
machine); build it without them, keeping AVX-512:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      .venv/bin/pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cpu_vs_vllm
from cpu_real import QUESTIONS, SYSTEM, have_llama_cpp, timed_runs
from llama_1b_weights import OUT, ensure, parameters
from machine import machine_line

HERE = Path(__file__).resolve().parent
EOS = 2
COPY_BYTES = 1 << 30
AMX_ENV = "KVSERVE_AMX"  # kvserve.model.cpu_kernels.quant_matmul's
NO_TILES = "/vnni"
"""A row name's suffix: that row with AMX tiles off (`gguf/vnni`: every packed matmul on
AVX-512 VNNI, as on a CPU without AMX)."""


def prompts(model: Path, n: int) -> list[list[int]]:
    from kvserve.model.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    out = []
    for question in QUESTIONS[:n]:
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def one_request_worker(row: str, model: str, threads: int, work: dict, repeat: int) -> dict:
    """Seconds per repeat of the prompts one at a time, in this process."""
    requests, new = work["prompts"], work["tokens"]
    if row == "llama.cpp":
        from llama_cpp import Llama

        llama = Llama(model, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)

        def run() -> None:
            for r in requests:
                llama.reset()
                llama.create_completion(
                    r, max_tokens=new, temperature=0.0, logit_bias={EOS: float("-inf")}
                )

    else:
        from kvserve import LLM, SamplingParams

        if row.endswith(NO_TILES):  # before the kernel loads
            os.environ[AMX_ENV], row = "0", row.removesuffix(NO_TILES)
        quant, _, acts = row.partition("+")
        if quant == "gguf":
            dtype = "bfloat16" if acts == "bf16" else "float32"
            llm = LLM(model, dtype=dtype, quantization="gguf", num_threads=threads)
        else:
            llm = LLM(model, dtype=quant, num_threads=threads)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

        def run() -> None:
            llm.reset_prefix_cache()
            for r in requests:
                llm.generate([r], params, use_tqdm=False)

    return {"seconds": timed_runs(run, repeat), "tokens": len(requests) * new}


def copy_worker(threads: int, repeat: int) -> dict:
    """STREAM-style copy bandwidth (bytes read + written per second) with `threads`, the
    best of two copies: between torch's own allocations (4 KiB pages unless transparent
    huge pages are `always`) and between buffers on 2 MiB pages (`madvise`d, as kvserve's
    weights are; None where the kernel gives none). The bound takes the faster: what this
    machine can read, not what one allocator gets."""
    import torch

    from kvserve.model.memory.huge_pages import huge_empty_like

    torch.set_num_threads(threads)

    def best_copy(src: torch.Tensor, dst: torch.Tensor) -> float:
        dst.copy_(src)
        best = float("inf")
        for _ in range(max(repeat, 5)):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return 2 * COPY_BYTES / best / 1e9

    src = torch.ones(COPY_BYTES // 4)
    plain = best_copy(src, torch.empty_like(src))
    huge_src, huge_dst = huge_empty_like(src), huge_empty_like(src)
    huge = None
    if huge_src is not None and huge_dst is not None:
        huge_src.copy_(src)
        del src
        huge = best_copy(huge_src, huge_dst)
    return {"gbs": max(plain, huge or 0.0), "plain": plain, "huge": huge}


def run_child(argv: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--child", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    if proc.returncode:
        raise RuntimeError(f"{argv} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def weight_bytes(row: str, gguf_file: Path) -> float:
    """Bytes of weights a decode step reads: every matrix once (the tied embedding as the
    output layer); a Q4_0 row is held to the file's tensor bytes."""
    if row.startswith("gguf") or row == "llama.cpp":
        from gguf import GGUFReader

        return float(sum(int(t.n_bytes) for t in GGUFReader(str(gguf_file)).tensors))
    return parameters() * (4 if row == "float32" else 2)


def one_at_a_time(args: argparse.Namespace, hf: Path, gguf_file: Path, work: Path) -> None:
    rows = (["llama.cpp"] if have_llama_cpp() and not args.skip_llama_cpp else []) + list(
        args.one_at_a_time
    )
    results: dict[str, dict] = {}
    copy_kinds: list[dict] = []
    for round_ in range(args.rounds):  # the rows in opposite orders: a drifting machine
        order = rows if round_ % 2 == 0 else rows[::-1]  # weighs on every row alike
        for i, row in enumerate(order, 1):
            print(f"[round {round_ + 1}, {i}/{len(rows)}] one at a time: {row}",
                  file=sys.stderr, flush=True)  # fmt: skip
            model = gguf_file if row == "llama.cpp" or row.startswith("gguf") else hf
            argv = ["one", row, str(model), str(args.threads), str(work), str(args.repeat)]
            # this machine's bandwidth drifts from minute to minute: measured before each run
            copied = run_child(["copy", str(args.threads), str(args.repeat)], args.threads)
            copy_kinds.append(copied)
            r = run_child(argv, args.threads)
            results.setdefault(row, {"seconds": [], "copies": [], "tokens": r["tokens"]})
            results[row]["seconds"] += r["seconds"]
            results[row]["copies"] += [copied["gbs"]] * len(r["seconds"])
    copies = [c for r in results.values() for c in r["copies"]]
    copy = statistics.median(copies)
    plain = [c["plain"] for c in copy_kinds]
    huge = [c["huge"] for c in copy_kinds if c["huge"] is not None]
    on_huge = (f"on 2 MiB pages {min(huge):.1f}-{max(huge):.1f}, " if huge
               else "no 2 MiB pages here, ")  # fmt: skip
    print(f"\nOne request at a time ({args.prompts} chats x {args.tokens} tokens), output "
          f"tok/s; copy bandwidth {min(copies):.1f}-{max(copies):.1f} GB/s (median {copy:.1f}; "
          f"{on_huge}on torch's allocations {min(plain):.1f}-{max(plain):.1f}) "
          f"with {args.threads} threads, measured before each run; the bound at the median, "
          f"a row's share of it the median of its runs' shares, each against the copy "
          f"measured before it:\n"
          f"{'row':<12} {'weights':<22} {'median':>8} {'best':>8} {'vs llama.cpp':>13} "
          f"{'bound':>8} {'of bound':>9}")  # fmt: skip
    base = results.get("llama.cpp")
    base_rate = statistics.median(base["tokens"] / s for s in base["seconds"]) if base else None
    for row, r in results.items():
        rates = [r["tokens"] / s for s in r["seconds"]]
        rate = statistics.median(rates)
        size = weight_bytes(row, gguf_file)
        bound = copy * 1e9 / size
        share = statistics.median(
            rate_i / (c * 1e9 / size) for rate_i, c in zip(rates, r["copies"], strict=True)
        )
        weights = f"{'Q4_0 GGUF' if row == 'llama.cpp' or row.startswith('gguf') else 'HF'}"
        weights += f", {size / 1e9:.2f} GB"
        ratio = f"{rate / base_rate:.2f}x" if base_rate else "-"
        print(f"{row:<12} {weights:<22} {rate:>8.2f} {max(rates):>8.2f} {ratio:>13} "
              f"{bound:>8.2f} {share:>8.0%}")  # fmt: skip
    if base is None:
        print("llama.cpp row skipped: `.venv/bin/pip install llama-cpp-python diskcache`")


def batched(args: argparse.Namespace, hf: Path, requests: list[list[int]]) -> None:
    if not args.vllm_python.exists():
        print(f"\nbatched rows skipped: no vLLM environment at {args.vllm_python} "
              "(cpu_vs_vllm.py's docstring says how to make one)")  # fmt: skip
        return
    work = {"max_tokens": args.tokens, "batched": [requests], "one_at_a_time": []}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
    options = argparse.Namespace(
        vllm_python=args.vllm_python, model=hf, threads=args.threads, repeat=args.repeat,
        eager=args.eager,
    )  # fmt: skip
    engines = ["kvserve iomp", "vLLM iomp"]
    results: dict[tuple[str, str], dict] = {}
    for round_ in range(args.rounds):  # the engines in opposite orders, as above
        for dtype in args.batched:
            for engine in engines if round_ % 2 == 0 else engines[::-1]:
                print(f"batched: {engine} {dtype}", file=sys.stderr, flush=True)
                r = cpu_vs_vllm.run_offline(engine, dtype, options, f.name)
                print(json.dumps(r), file=sys.stderr, flush=True)
                if (engine, dtype) not in results:
                    results[(engine, dtype)] = r
                else:
                    runs = results[(engine, dtype)]["modes"][f"batched {len(requests)}"]
                    runs["seconds"] += r["modes"][f"batched {len(requests)}"]["seconds"]
    os.unlink(f.name)
    cpu_vs_vllm.print_offline(results, engines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="rounds in opposite orders")
    parser.add_argument("--prompts", type=int, default=4, help="chats one at a time")
    parser.add_argument("--batch", type=int, default=16, help="chats at once")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per chat")
    parser.add_argument("--one-at-a-time", nargs="*", default=["gguf", "gguf+bf16", "bfloat16"])
    parser.add_argument("--batched", nargs="*", default=["bfloat16", "float32"])
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--eager", action="store_true", help="vLLM with enforce_eager")
    parser.add_argument("--vllm-python", type=Path, default=cpu_vs_vllm.DEFAULT_VLLM)
    parser.add_argument("--out", type=Path, default=OUT, help="where the checkpoint is")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "copy":
            result = copy_worker(int(rest[0]), int(rest[1]))
        else:
            row, model, threads, work_file, repeat = rest
            work = json.loads(Path(work_file).read_text())
            result = one_request_worker(row, model, int(threads), work, int(repeat))
        print(json.dumps(result))
        return 0
    hf, gguf_file = ensure(args.out)
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  "
          f"{machine_line(args.threads)}; a random Llama of {parameters() / 1e9:.2f}B "
          f"parameters (llama_1b_weights.py); {args.repeat} timed runs per row")  # fmt: skip
    chats = prompts(hf, max(args.prompts, args.batch))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": chats[: args.prompts], "tokens": args.tokens}, f)
    if args.one_at_a_time or not args.skip_llama_cpp:
        one_at_a_time(args, hf, gguf_file, Path(f.name))
    os.unlink(f.name)
    if args.batched:
        batched(args, hf, chats[: args.batch])
    return 0


if __name__ == "__main__":
    sys.exit(main())
