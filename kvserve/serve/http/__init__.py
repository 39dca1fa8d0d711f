"""The HTTP server's own plumbing: what sits between the socket and any API's handler.

Errors and their body (errors.py), request size and time limits (limits.py),
idle and slow connections (connections.py), a request's priority and its end
when the client leaves (admission.py), Prometheus metrics (metrics.py), the
engine's own thread (engine_thread.py) and the tokenizer's worker thread
(tokenizer_worker.py) that keep the event loop free, the KV metadata a router
reads (kv_metadata.py), the LoRA adapters served by name (adapters.py) and the
OpenAPI document (openapi.py). Nothing here knows
an API's request or answer shapes: it imports no other room of kvserve.serve.
"""
