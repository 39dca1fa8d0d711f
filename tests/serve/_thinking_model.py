"""A tiny Qwen3 that thinks on cue: the demo checkpoint with `<think>` / `</think>` tokens,
a Qwen3-style chat template, and weights whose greedy answer is known.

Every layer's output projections are zeroed, so a position's final hidden state is
the normed embedding of its own token, and the untied lm_head maps each token of a
chain to the next: the greedy answer to any chat prompt is
`<think>` REASONING `</think>` CONTENT and the end of text. Real weights on the real
path (attention still runs, it adds nothing): what the server returns is what the model
wrote, so the reasoning split is tested on text whose right split is known.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""Qwen3's: `enable_thinking: false` writes an empty think block into the prompt."""
REASONING_WORDS = (" That", " small", " light")
CONTENT_WORDS = (" Every", " answer")


def build_thinking_model(demo: str, path: Path) -> tuple[str, str]:
    """The checkpoint at `path`; returns (its reasoning text, its content text)."""
    shutil.copytree(demo, path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.save(str(path / "tokenizer.json"))
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    words = [tokenizer.encode(w).ids for w in (*REASONING_WORDS, *CONTENT_WORDS)]
    assert all(len(ids) == 1 for ids in words), words
    split = len(REASONING_WORDS)
    reasoning, content = [w[0] for w in words[:split]], [w[0] for w in words[split:]]
    start = tokenizer.encode("<|im_start|>assistant\n").ids[-1]
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    eos = config["eos_token_id"]
    chain = [start, think, *reasoning, end, *content, eos]
    assert len(set(chain)) == len(chain), chain
    weights = load_file(str(path / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(7)
    embed = torch.cat([embed, torch.randn(2, embed.shape[1], generator=gen) * embed.std()])
    weights["model.embed_tokens.weight"] = embed
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    head = torch.zeros_like(embed)
    for token, following in itertools.pairwise(chain):
        head[following] = 20 * torch.nn.functional.normalize(embed[token], dim=0)
    weights["lm_head.weight"] = head
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.update(vocab_size=embed.shape[0], tie_word_embeddings=False)
    config_file.write_text(json.dumps(config))
    tok_config_file = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_file.read_text())
    tok_config_file.write_text(json.dumps({**tok_config, "chat_template": TEMPLATE}))
    return "".join(REASONING_WORDS), "".join(CONTENT_WORDS)
