"""The demo checkpoint with a chat template that renders tools, Hermes style (as Qwen's
does): the tools offered in a system turn, an assistant turn's calls as
`<tool_call>` blocks whose arguments are a dict (`tojson` of a string would quote it),
and a tool's result in `<tool_response>`. Its markers make the server pick the hermes
parser by itself. `<tool_call>` and `</tool_call>` are single tokens, as in Qwen's
vocabulary (the embeddings grow by a few random rows), so a test can bias the model
towards starting a call."""

from __future__ import annotations

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


def tool_checkpoint(demo: str, folder: Path) -> str:
    """The demo checkpoint with TOOL_TEMPLATE and the markers as tokens, saved in `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = folder / "demo-tools"
    if not target.is_dir():
        tmp = folder / "demo-tools.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(demo)
        tokenizer.add_tokens(MARKERS)
        tokenizer.chat_template = TOOL_TEMPLATE
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32)
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    return str(target)
