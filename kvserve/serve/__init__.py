"""`kvserve serve`: an OpenAI-compatible HTTP server around one engine.

The HTTP event loop never runs a model step: the engine lives in its own
thread (http/engine_thread.py), requests reach it through a thread-safe queue
and its outputs come back to per-request asyncio queues. The room, by sub-room,
each importing only those listed before it (state.py also holds the Responses
API's store; tests/structure/test_serve_room.py checks the layers):

- http/: the server's own plumbing, no API's shapes: errors, body and time
  limits, connections, admission, metrics, the engine thread, the tokenizer's
  worker thread, /kv-metadata and the OpenAPI document.
- request/: a request body read into engine inputs (protocol.py: SamplingParams;
  fields.py: the field rule; structured.py, tools.py, reasoning.py,
  grammar_limits.py: constraints, tool calls, reasoning).
- state.py: what every handler shares (the engine thread, limits, the name).
- generation/: one generation request's life, shared by every API: its prompt
  checked and tokenized (prompts.py), submitted (submit.py), answered whole or
  streamed (stream.py), its bodies built (job.py, logprobs.py; chat_blocks.py
  for the APIs that answer in blocks).
- openai/, responses_api/, messages_api/: each API's route handlers.
- app.py (the routes), build.py (a server from options), lifecycle.py (drain).
"""
