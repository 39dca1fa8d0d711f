"""Random LoRA adapters for the fuzzer, written for whatever the engine adapts.

The projections come from a live engine's LoRA slots (kvserve.lora.slots: every
(layer, module) it wraps, with its widths), so one writer serves every family,
hybrids and mixtures of experts included: each adapter updates the attention's
q and v (Phi-3's fused qkv) and o, and an MoE's experts' down_proj (the fused 3-D
weight of transformers 5, one LoRA per expert: each expert sees some rows of a
mixed batch), PEFT's file layout, random A and B.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve import LLM
from kvserve.lora.weights import in_features

TARGETS = ("q_proj", "v_proj", "o_proj", "qkv_proj")
RANK = 4


def write_adapters(llm: LLM, root: Path, count: int = 2) -> list[str]:
    """`count` random adapters for `llm`'s model under `root`; their directories."""
    slots = llm.engine.runner.lora
    assert slots is not None, "the engine needs enable_lora"
    chosen = {
        key: p
        for key, p in slots.projections.items()
        if key[1].startswith("self_attn.") and key[1].split(".")[-1] in TARGETS
    }
    if any(path.endswith("qkv_proj") for _, path in chosen):  # fused: adapt it whole
        chosen = {k: p for k, p in chosen.items() if k[1].endswith(("qkv_proj", "o_proj"))}
    paths = []
    for n in range(count):
        generator = torch.Generator().manual_seed(1000 + n)
        tensors = {}
        for (layer, where), projection in sorted(chosen.items()):
            _, width = projection.part_offsets[where.split(".")[-1]]
            fan_in = in_features(projection)
            key = f"base_model.model.model.layers.{layer}.{where}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=generator) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, RANK, generator=generator) * 0.3
        experts = {k: w for k, w in slots.targets.expert_parameters.items() if k[1] == "down_proj"}
        for (layer, _), wrappers in sorted(experts.items()):
            count, fan_in, out = len(wrappers), in_features(wrappers[0]), wrappers[0].out_features
            key = f"base_model.model.model.layers.{layer}.mlp.experts"
            a = torch.randn(RANK * count, fan_in, generator=generator) * 0.3
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK * count, generator=generator)
        path = root / f"adapter-{n}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "adapter_model.safetensors")
        targets = sorted({where.split(".")[-1] for _, where in chosen})
        config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none",
                  "target_modules": targets}  # fmt: skip
        if experts:
            config["target_parameters"] = ["mlp.experts.down_proj"]
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(str(path))
    return paths
