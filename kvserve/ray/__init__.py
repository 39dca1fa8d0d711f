"""kvserve on Ray Serve: replicas of kvserve engines behind Serve's proxy, routed exactly.

`serve run kvserve.ray:app model=... num_replicas=4` (or a Serve config file with
`import_path: kvserve.ray:app`). The only part of kvserve that imports Ray (the optional
extra `kvserve[ray]`); README "Several machines: Ray Serve", docs/several-engines.md.

Files: `app`, the builder (app.py; its arguments, options.py: deployment options, the rest
parsed by `kvserve serve`'s own parser); the replica (replica.py: serve/build.py's engine,
events on the node's address, advertised in its routing stats); the ingress (ingress.py:
the body read, the call through the handle, the answer relayed, a replica that failed
before its first message retried); one HTTP request over a Ray call, its path the one
below Serve's route prefix (asgi.py); the request router (router.py: router/follower.py,
router/prompts.py and routing/ in Serve's request-router API, Serve's Power-of-Two choice
where it cannot predict); the ingress's /metrics and the predictions checked against the
answers (book.py); prefill on one replica, decode on another (the builder's `prefill` and
`decode` sections; split.py: each prompt on a prefill replica first, its block server's
endpoint handed to the decode replica with the request); run-time LoRA adapters (adapters.py:
a load or unload sent to every replica, kept in the application's adapter book, which a
replica Serve starts later reads).
"""

from kvserve.ray.app import app, build_app

__all__ = ["app", "build_app"]
