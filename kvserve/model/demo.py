"""A tiny Qwen3 checkpoint built locally, so `kvserve generate` works without a download.

The weights are random but fixed (seeded), the tokenizer is a byte-level BPE
trained on a built-in text: every machine builds byte-identical weights.
Creation is atomic (build in a temp dir, then rename), so processes racing to
create it are safe and a crash never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvserve.model.checkpoint.cache_root import default_cache_root
from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.demo_text import DEMO_TEXT
from kvserve.model.models import Qwen3ForCausalLM

DEMO_NAME = "demo-qwen3-v1"
DEMO_SEED = 1234
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": None,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


def ensure_demo_model(cache_dir: str | Path | None = None) -> str:
    """Path of the demo checkpoint, `<cache_dir>/demo-qwen3-v1`, created on first call.

    `cache_dir` defaults to `$XDG_CACHE_HOME/kvserve` (or `~/.cache/kvserve`).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / DEMO_NAME
    if target.is_dir():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.tmp-", dir=root))
    try:
        write_demo_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # another process did not win the race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def write_demo_model(path: Path) -> None:
    """Write config, generation config, tokenizer and seeded weights into `path`."""
    tokenizer = build_tokenizer()
    eos_ids = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")]
    config = {**DEMO_CONFIG, "vocab_size": tokenizer.get_vocab_size(), "eos_token_id": eos_ids[0]}
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"eos_token_id": eos_ids})
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "unk_token": None,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    save_file(seeded_weights(config), str(path / "model.safetensors"), metadata={"format": "pt"})


def seeded_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Random weights from a fixed seed, in a fixed name order: identical everywhere.

    Unit-variance embeddings and projections scaled by 2/sqrt(fan_in) keep the
    activations lively: with the usual 0.02 init, a tied random model repeats
    one token forever, which makes a dull demo and hides engine bugs.
    """
    with torch.device("meta"):
        shapes = Qwen3ForCausalLM(ModelConfig.from_dict(config)).state_dict()
    gen = torch.Generator().manual_seed(DEMO_SEED)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name].shape
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith("embed_tokens.weight"):
            weights[name] = torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) * (2.0 / shape[-1] ** 0.5)
    return weights


def build_tokenizer() -> Any:
    """Byte-level BPE trained on DEMO_TEXT in four casings (enough words for ~2k tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = DEMO_TEXT.splitlines()
    corpus = lines + [s.upper() for s in lines] + [s.title() for s in lines]
    corpus += [s.lower() for s in lines]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
