"""One served engine from `kvserve serve`'s options: the LLM, its engine thread, the state the
handlers share. `kvserve serve` puts it behind uvicorn; a Ray Serve replica (kvserve.ray)
behind Ray's proxy: both run the very same engine thread and handlers."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI

from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.lora.modules import AdapterModule, parse_lora_module
from kvserve.lora.request import LoRARequest, resolve_adapter
from kvserve.serve.app import create_app
from kvserve.serve.http.adapters import ServedAdapters
from kvserve.serve.http.engine_thread import EngineThread
from kvserve.serve.http.kv_metadata import kv_metadata_body
from kvserve.serve.http.limits import ServeLimits
from kvserve.serve.http.metrics import EngineObserver, ServerMetrics, cache_config_info
from kvserve.serve.responses_api.store import ResponseStore
from kvserve.serve.state import ServerState

log = logging.getLogger("kvserve.serve")


@dataclass(slots=True)
class ServedEngine:
    llm: LLM
    engine: EngineThread
    state: ServerState

    def app(self) -> FastAPI:
        return create_app(self.state)

    def close(self) -> None:
        """Stop the engine thread, then the engine (its last KV events go out)."""
        self.engine.stop()
        self.state.tokens.close()
        events = self.llm.engine.kv_events
        self.llm.shutdown()
        if events is not None:
            log.info("KV events: the last batch (seq %d) is sent", events.publisher.last_seq)


def build_served_engine(
    args: argparse.Namespace,
    engine_args: EngineArgs,
    limits: ServeLimits,
    api_key: str | None,
    on_death: Callable[[str], None],
) -> ServedEngine:
    """`args`: `kvserve serve`'s options (model, name, metrics, queue); the engine thread is
    built, not started; `on_death(reason)` runs on it if it dies."""
    llm = LLM(args.model, **dataclasses.asdict(engine_args))
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    try:
        adapters = served_adapters(llm, name, getattr(args, "lora_modules", None) or [])
    except ValueError:
        llm.shutdown()
        raise
    metrics = ServerMetrics(args.metrics_prefix, name, cache_config_info(llm.engine))
    observer = EngineObserver(metrics)
    observer.refresh(llm.engine)
    engine = EngineThread(llm.engine, observer, on_death=on_death)
    state = ServerState(
        engine=engine,
        served_name=name,
        description=llm.model.description,
        api_key=api_key,
        max_model_len=llm.engine.scheduler.config.max_model_len,
        max_request_tokens=llm.engine.scheduler.max_request_tokens(),
        metrics=metrics,
        max_queued_requests=args.max_queued_requests,
        log_requests=args.log_requests,
        kv_metadata=kv_metadata_body(llm.engine, llm.model.path, name, args.pooling),
        limits=limits,
        responses=ResponseStore(args.responses_store_size, args.responses_store_mb),
        tool_call_parser=args.tool_call_parser,
        pooling=args.pooling,
        reasoning_parser=args.reasoning_parser,
        adapters=adapters,
    )
    assert state.kv_metadata is not None
    reported = state.tokens.prompt_limits(state.max_n, limits.max_tools)
    state.kv_metadata["limits"] = reported.as_dict()
    return ServedEngine(llm, engine, state)


def served_adapters(llm: LLM, name: str, modules: list[AdapterModule]) -> ServedAdapters | None:
    """`--lora-modules` resolved before the socket opens (the engine thread is not running
    yet): a bad one is a ValueError naming it; None without enable_lora."""
    loras = llm.engine.loras
    if loras is None:
        return None
    adapters = ServedAdapters(name)
    for module in modules:
        try:
            lora = adapters.reserve(module.name, module.path)
            adapter = loras.resolve(lora)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {exc}") from None
        adapters.add(lora, adapter.identity, module.base_model_name)
        log.info("LoRA adapter %r: %s (%s)", module.name, module.path, adapter.identity[:24])
    return adapters


def lora_options(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    """`--lora-modules` read into `args` (each adapter's files checked, before the engine is
    built) and `--enable-lora` turned on by them: what `kvserve serve` and a Ray Serve
    replica both do with `kvserve serve`'s options."""
    texts = getattr(args, "lora_modules", None) or []
    if texts and isinstance(texts[0], AdapterModule):
        return  # read already
    args.lora_modules = _read_lora_modules(texts, engine_args.max_lora_rank)
    engine_args.enable_lora = engine_args.enable_lora or bool(args.lora_modules)


def _read_lora_modules(texts: list[str], max_lora_rank: int) -> list[AdapterModule]:
    """`--lora-modules` read, and each adapter's files checked before the engine is built
    (the base model's shapes are checked once it is): a ValueError naming the bad one."""
    modules = [parse_lora_module(text) for text in texts]
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        seen.add(module.name)
        try:
            resolve_adapter(LoRARequest(module.name, 1, module.path), max_lora_rank)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {exc}") from None
    return modules
