"""`kvserve serve`: an OpenAI-compatible HTTP server around one engine.

The HTTP event loop never runs a model step: the engine lives in its own
thread (engine_thread.py), requests reach it through a thread-safe queue and
its outputs come back to per-request asyncio queues. app.py holds the routes
that are not generation, completions.py the two generation endpoints,
protocol.py turns request bodies into SamplingParams, fields.py decides what
happens to a field not served (refused or ignored), errors.py OpenAI's error
body.
"""
