"""`kvserve route`: an OpenAI-compatible router over several `kvserve serve` replicas.

It predicts each replica's prefix-cache hit for a request (the replicas' KV
events fed into a PrefixIndex, the request tokenized as they tokenize it),
lets a routing policy (kvserve.routing) choose, and forwards the request
unchanged, relaying the answer byte for byte. It never imports the engine,
the server or the model's torch code: only the events, the chat template and
the tokenizer loading.

Its files are named as kvserve/serve/'s where they do the same job: app.py,
build.py, state.py and lifecycle.py as at serve's top; errors.py, limits.py and
metrics.py as serve/http/'s; prompts.py, a request's prompts as the replica will
tokenize them (serve/generation/prompts.py renders them there). The rest is the
router's own: replicas.py, health.py, follower.py (their KV events), forward.py.
"""

from kvserve.router.build import build_router, serve_router

__all__ = ["build_router", "serve_router"]
