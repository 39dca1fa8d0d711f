"""Tool calling: the tools a chat request offers, and the calls found in a model's output.

One parser per model family's output format (hermes.py, llama3_json.py), named
as vLLM names them and chosen from the checkpoint's chat template or by
`kvserve serve --tool-call-parser` (registry.py). Each knows its own format
both ways: it reads calls out of text (whole, or delta by delta: stream.py)
and says what one call looks like, so the grammar that forces or guards a call
(request.py, through kvserve.structured.tags) is written in the format the
parser reads back. Pure Python: the server and the offline API use it alike.

Files: request.py (`tools`, `tool_choice`, `parallel_tool_calls` checked, ValueError
naming the field; the structural tag that forces a call or guards one from the trigger
on), parser.py (ToolParser: what every family shares; calls are JSON objects
`{"name", KEY}`), one file per family's format (hermes.py, llama3_json.py), registry.py
(by name, or from the chat template's markers), stream.py (one completion's calls read
delta by delta), types.py (ToolCall, ParsedOutput, ToolCallDelta: plain data).
"""
