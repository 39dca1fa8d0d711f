"""`kvserve kv-metadata`: how an engine on a checkpoint hashes and groups its KV cache."""

from __future__ import annotations

import argparse
import json

from kvserve.cli.common import HelpFormatter
from kvserve.cli.engine_options import add_engine_options

# The engine options that decide hashes and groups; the same flags as `generate`'s.
HASHING_FIELDS = ("block_size", "hash_fn", "hash_seed")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv-metadata",
        help="print how an engine on a checkpoint hashes and groups its KV cache (JSON)",
        description=(
            "Print, as JSON, what a consumer of KV cache events needs to hash and match "
            "the way the engine does: per group its kind, physical block size, hash block "
            "size and window, and the hash function and seed. Reads config.json (or a GGUF "
            "file's metadata) only."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face checkpoint directory, .gguf file, or a directory holding one",
    )
    add_engine_options(p, only=HASHING_FIELDS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvserve.kvcache.config import KVCacheConfig
    from kvserve.kvcache.event_metadata import kv_events_metadata
    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.model.checkpoint.config import load_model_config
    from kvserve.model.memory.kv_layout import layer_kv_specs
    from kvserve.model.memory.layer_groups import group_layers
    from kvserve.model.models import model_class

    config = load_model_config(args.model)
    model_class(config.architecture)  # an engine could not run it: its metadata would lie
    layout = group_layers(layer_kv_specs(config, args.block_size, torch.float32))
    manager = KVCacheManager(
        KVCacheConfig(
            num_blocks=2,
            block_size=args.block_size,
            hash_fn=args.hash_fn,
            hash_seed=args.hash_seed,
            specs=layout.specs,
        )
    )
    print(json.dumps(kv_events_metadata(manager), indent=2))
    return 0
