"""The demo checkpoint with a chat template that renders tools, Hermes style (as Qwen's
does): the tools offered in a system turn, an assistant turn's calls as
`<tool_call>` blocks whose arguments are a dict (`tojson` of a string would quote it),
and a tool's result in `<tool_response>`. Its markers make the server pick the hermes
parser by itself. `<tool_call>` and `</tool_call>` are single tokens, as in Qwen's
vocabulary (the embeddings grow by a few random rows), so a test can bias the model
towards starting a call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>. Functions:
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


MARKERS = ["<tool_call>", "</tool_call>"]
TOOL_MODEL = "demo-tools"
"""The name the tool server serves it under."""


def tool_checkpoint(demo: str, folder: Path) -> str:
    """The demo checkpoint with TOOL_TEMPLATE and the markers as tokens, saved in `folder`.
    Edited in place of a copy (no model class loaded: the embeddings are one tensor)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    target = folder / "demo-tools"
    if target.is_dir():
        return str(target)
    tmp = folder / "demo-tools.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(demo, tmp)
    tokenizer = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(marker, special=False) for marker in MARKERS])
    tokenizer.save(str(tmp / "tokenizer.json"))
    tokenizer_config = json.loads((tmp / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TOOL_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((tmp / "config.json").read_text())
    rows = -(-tokenizer.get_vocab_size() // 8) * 8  # padded, as checkpoints often are
    weights = load_file(tmp / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]  # tied: the output layer too
    new = torch.Generator().manual_seed(0)
    extra = torch.randn(rows - embed.shape[0], embed.shape[1], generator=new) * embed.std()
    weights["model.embed_tokens.weight"] = torch.cat([embed, extra.to(embed.dtype)])
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    config["vocab_size"] = rows
    (tmp / "config.json").write_text(json.dumps(config))
    tmp.rename(target)
    return str(target)
