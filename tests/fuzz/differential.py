"""The differential fuzzer: a busy engine against each request alone with caching off.

Each workload (workloads.py) runs through `LLMEngine` step by step, as a
server drives it: requests arrive at their steps, some are aborted, the KV
cache's invariants (`check_invariants`: ref counts, free queue, index,
windows, no content held twice) are checked after every step. Every request
that finishes must give the tokens the same request gives alone, on an
engine with prefix caching off and a pool that never preempts (greedy, or
seeded sampling: each completion's seed is its own). Findings:

- `mismatch`: a completion differs from its lone run;
- `hang`: no step ran for a while with work waiting, or the step budget ran out;
- `leak`: blocks still held once every request is done;
- `duplicate` / `invariant`: a KV cache invariant broke (the message says which);
- `error`: a request finished with an error, or the engine raised.

Written here rather than with Hypothesis' stateful machines: a workload is a
whole engine run of many steps whose reference runs are cached across
workloads, and an hour-long run must report each finding's minimal workload
(shrink.py) as plain JSON to replay.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.kvcache import InvariantError, check_invariants
from kvserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from tests.fuzz.adapters import write_adapters
from tests.fuzz.models import QUANTIZED_ARCHS, quantization
from tests.fuzz.workloads import FuzzRequest, Workload

STALL_STEPS = 50
"""Steps in a row that schedule nothing while work waits (and nothing arrives) = a hang."""
TIE = 1e-4
"""Float32 sums in another order (a batch, a chunk, a verified draft) move logprobs by
~1e-6; a cache fault moves them far more. A greedy mismatch where the lone run's two best
tokens are closer than this, or a seeded one where both runs have the same best token
with logprobs this close (the same distribution, a draw on a boundary), is counted as a
tie, not reported."""
TIE_PACKED = 5e-2
"""The same for packed weights (tests/fuzz/models.py's QUANTIZED_ARCHS, which says why a
tie is wider there): it keeps most of the rounding out and any wrong block in."""
TIE_BFLOAT16 = 0.125
"""The same for bfloat16 engines (`References(dtype=...)`). A row's kernels depend on how
many rows its step has (one decode row: float32 sums rounded once; several, as a prefill,
a chunk or a draft's verification run them: transformers' bfloat16 arithmetic bit for
bit), and each layer's output rounded to 8 bits of mantissa turns that into logprob moves
of a few ulps of the logits (1/32 at magnitude 4-8; up to 0.07 seen on the dense
checkpoints), enough to flip a draw or a near-best token. So a bfloat16 mismatch is also a
tie when every busy token from it on is what one prefill of its own prefix gives
(`References.other_rows_agree`). Measured against faults: one wrong token early in a
prompt moves the next token's logprobs by a median 0.8-1.0 on the Llama, Qwen and Phi-3
checkpoints, 0.1-0.2 on Gemma's and Bamba's, so there the bfloat16 campaigns are weaker
than the float32 ones. Mixtures of experts stay out (models.py's BFLOAT16_ARCHS)."""


@dataclass
class Finding:
    kind: str
    """mismatch | hang | leak | duplicate | invariant | error"""
    detail: str
    workload: Workload

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


class References:
    """Each request's completions alone, prefix caching off, per checkpoint (cached)."""

    def __init__(self, paths: dict[str, str], dtype: str = "float32") -> None:
        self.paths = paths
        self.dtype = dtype
        """The engines' dtype, busy and lone alike (float32; bfloat16 with a wider tie)."""
        self._engines: dict[str, LLM] = {}
        self._adapters: dict[str, list[str]] = {}
        self._adapter_root = tempfile.TemporaryDirectory(prefix="kvserve-fuzz-lora-")
        self._done: dict[tuple[str, tuple[Any, ...]], list[int]] = {}
        self._tops: dict[tuple[str, tuple[Any, ...]], list[tuple[float, int, float]]] = {}
        """Per lone run, per position: (its best logprob, that token, the second best)."""

    def engine(self, arch: str) -> LLM:
        if arch not in self._engines:
            self._engines[arch] = LLM(self.paths[arch], dtype=self.dtype, device="cpu",
                                      num_threads=1, enable_prefix_caching=False,
                                      block_size=16, num_kv_blocks=256, enable_lora=True,
                                      quantization=quantization(arch))  # fmt: skip
        return self._engines[arch]

    def lora(self, arch: str, adapter: int | None) -> LoRARequest | None:
        """The fuzzer's adapter `adapter` of `arch` (written on first use); None: the base."""
        if adapter is None:
            return None
        if arch not in self._adapters:
            root = Path(self._adapter_root.name) / arch
            self._adapters[arch] = write_adapters(self.engine(arch), root)
        return LoRARequest(f"fuzz-{adapter}", 1 + adapter, self._adapters[arch][adapter])

    def num_groups(self, arch: str) -> int:
        return len(self.engine(arch).engine.runner.kv_cache_specs)

    def tokens(self, arch: str, request: FuzzRequest, index: int) -> list[int]:
        key = (arch, request.key(index))
        if key not in self._done:
            prompt, max_tokens, seed, adapter = key[1]
            params = SamplingParams(
                temperature=0.0 if seed is None else 1.0,
                seed=seed,
                max_tokens=max_tokens,
                logprobs=2,  # the best two (reading them changes no draw)
            )
            lora = self.lora(arch, adapter)
            out = self.engine(arch).generate([list(prompt)], params, use_tqdm=False,
                                             lora_request=lora)  # fmt: skip
            completion = out[0].outputs[0]
            self._done[key] = list(completion.token_ids)
            self._tops[key] = [_best_two(top) for top in completion.logprobs or ()]
        return self._done[key]

    def tie(self, arch: str) -> float:
        tie = TIE_PACKED if arch in QUANTIZED_ARCHS else TIE
        return max(tie, TIE_BFLOAT16) if self.dtype == "bfloat16" else tie

    def is_tie(
        self, arch: str, request: FuzzRequest, index: int, got: list[int], position: int, busy: Any
    ) -> bool:
        """Whether a busy completion `got`, first unlike its lone run at `position`, differs
        by rounding (see TIE); `busy`: the busy run's logprobs at each position (seeded
        requests ask for them), else None."""
        tops = self._tops.get((arch, request.key(index)), [])
        if position >= len(tops):
            return False
        best, token, second = tops[position]
        tie = self.tie(arch)
        if request.seed is None:
            same = best - second < tie
        elif busy is None:
            return False
        else:
            busy_best, busy_token, _ = _best_two(busy[position])
            same = busy_token == token and abs(busy_best - best) < tie
        if same or self.dtype != "bfloat16":
            return same
        return self.other_rows_agree(arch, request, index, got, position, busy)

    def other_rows_agree(
        self, arch: str, request: FuzzRequest, index: int, got: list[int], position: int, busy: Any
    ) -> bool:
        """bfloat16 (TIE_BFLOAT16): at `position` and every position after it, the lone
        engine runs the prompt and `got`'s tokens before it as one prefill (the kernels of
        several rows a step) and reads the next token's raw logprobs, the busy token's among
        them (a logit bias makes it the one sampled; logprobs are taken before any bias).
        Greedy: each busy token is that distribution's best, or within the tie of it.
        Seeded: the logprobs the busy run reported (its draw, its best) are that
        distribution's, within the tie. A fault that first shows as a near tie still has to
        pass every later token."""
        prompt, _, seed, adapter = request.key(index)
        if seed is not None and (busy is None or len(busy) < len(got)):
            return False
        tie = self.tie(arch)
        for q in range(position, len(got)):
            top = self._prefill_logprobs(arch, [*prompt, *got[:q]], got[q], adapter)
            if top is None:
                return False
            if seed is None:
                agree = max(top.values()) - top[got[q]] < tie
            else:
                agree = all(
                    t in top and abs(top[t] - lp.logprob) < tie for t, lp in busy[q].items()
                )
            if not agree:
                return False
        return True

    def _prefill_logprobs(
        self, arch: str, tokens: list[int], chosen: int, adapter: int | None
    ) -> dict[int, float] | None:
        """The next token's raw logprobs after `tokens` run as one prefill: the best
        MAX_LOGPROBS and `chosen`'s (None if the engine reported none)."""
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=MAX_LOGPROBS,
                                logit_bias={chosen: MAX_LOGIT_BIAS})  # fmt: skip
        out = self.engine(arch).generate([tokens], params, use_tqdm=False,
                                         lora_request=self.lora(arch, adapter))  # fmt: skip
        first = out[0].outputs[0].logprobs
        if not first or chosen not in first[0]:
            return None
        return {t: lp.logprob for t, lp in first[0].items()}


def _best_two(top: dict[int, Any]) -> tuple[float, int, float]:
    """(the best logprob, its token, the second best) of one position's logprobs."""
    ranked = sorted(top.items(), key=lambda item: -item[1].logprob)
    second = ranked[1][1].logprob if len(ranked) > 1 else float("-inf")
    return ranked[0][1].logprob, ranked[0][0], second


def _params(request: FuzzRequest) -> SamplingParams:
    if request.seed is None:
        return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, n=request.n)
    # Logprobs (they change no draw; seeded requests never draft): the tie check reads them.
    return SamplingParams(
        temperature=1.0,
        seed=request.seed,
        max_tokens=request.max_tokens,
        n=request.n,
        logprobs=1,
    )


def _options(workload: Workload, path: str, tier_dir: str) -> dict[str, Any]:
    options = dict(workload.options)
    if "offload" in options:
        options["offload"] = options["offload"].replace("{dir}", tier_dir)
    spec = options.get("speculative_config")
    if spec is not None and spec.get("model") == "{self}":
        options["speculative_config"] = {**spec, "model": path}
    return options


def run_workload(
    workload: Workload,
    references: References,
    on_refused: Callable[[int, str], None] | None = None,
    counts: Counter[str] | None = None,
) -> list[Finding]:
    """Run `workload` once; every finding it shows (empty: all exact).

    `counts` (when given) adds up what the run exercised: completions and tokens
    compared, preemptions, prefix and external hits, drafts, refusals."""
    path = references.paths[workload.arch]
    with tempfile.TemporaryDirectory(prefix="kvserve-fuzz-") as tier_dir:
        llm = LLM(path, dtype=references.dtype, device="cpu", num_threads=1,
                  quantization=quantization(workload.arch),
                  **_options(workload, path, tier_dir))  # fmt: skip
        try:
            counts = Counter() if counts is None else counts
            return _drive(workload, llm, references, on_refused, counts)
        finally:
            llm.shutdown()


def _drive(
    workload: Workload,
    llm: LLM,
    references: References,
    on_refused: Callable[[int, str], None] | None,
    counts: Counter[str],
) -> list[Finding]:
    engine = llm.engine
    findings: list[Finding] = []

    def found(kind: str, detail: str) -> list[Finding]:
        findings.append(Finding(kind, detail, workload))
        return findings

    requests = workload.requests
    budget = 60 + 8 * sum((len(r.prompt) + r.max_tokens) * r.n for r in requests)
    last_arrival = max((r.arrival for r in requests), default=0)
    outputs: dict[str, Any] = {}
    live: set[int] = set()
    idle = 0
    for step in range(budget):
        for i, request in enumerate(requests):
            if request.arrival == step:
                try:
                    lora = references.lora(workload.arch, request.adapter)
                    engine.add_request(
                        str(i), list(request.prompt), _params(request), lora_request=lora
                    )
                    live.add(i)
                except ValueError as exc:  # it can never fit this pool: refused, as it must
                    counts["refused"] += 1
                    if on_refused is not None:
                        on_refused(i, str(exc))
            if request.abort_at == step and i in live:
                engine.abort_request(str(i))
                live.discard(i)
        if not engine.has_unfinished_requests() and step >= last_arrival:
            break
        try:
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
                    live.discard(int(output.request_id))
            running = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
            check_invariants(engine.manager, running)
        except InvariantError as exc:
            kind = "duplicate" if "duplicate" in str(exc) else "invariant"
            return found(kind, f"step {step}: {exc}")
        except Exception as exc:  # the engine itself failed: the worst finding
            return found("error", f"step {step}: {type(exc).__name__}: {exc}")
        stalled = engine.last_step_num_chunks == 0 and engine.has_unfinished_requests()
        idle = idle + 1 if stalled and step >= last_arrival else 0
        if idle >= STALL_STEPS:
            return found("hang", f"step {step}: {idle} steps scheduled nothing with work waiting")
    else:
        return found("hang", f"the step budget ({budget}) ran out")
    stats = llm.stats()
    for name in ("preemptions", "prefix_hit_tokens", "external_hit_tokens", "spec_draft_tokens"):
        counts[name] += stats.get(name, 0)
    if engine.manager.pool.num_used:
        found("leak", f"{engine.manager.pool.num_used} blocks held after every request ended")
    if engine.tracker.duplicates_peak:
        found("duplicate", f"duplicate_blocks_peak {engine.tracker.duplicates_peak}")
    for rid, output in outputs.items():
        request = requests[int(rid)]
        for index, completion in enumerate(output.outputs):
            if completion.finish_reason == "abort":
                continue
            if completion.finish_reason not in ("length", "stop"):
                found("error", f"request {rid}.{index}: finished with {completion.finish_reason}")
                continue
            want = references.tokens(workload.arch, request, completion.index)
            got = list(completion.token_ids)
            counts["completions"] += 1
            counts["tokens"] += len(got)
            if got != want:
                pairs = enumerate(zip(got, want, strict=False))
                first = next((k for k, (x, y) in pairs if x != y), min(len(got), len(want)))
                busy = completion.logprobs or None
                index = completion.index
                if references.is_tie(workload.arch, request, index, got, first, busy):
                    counts["ties"] += 1
                    continue
                found("mismatch", f"request {rid}.{completion.index}: {got} != lone {want} "
                                  f"(first difference at {first})")  # fmt: skip
    return findings
