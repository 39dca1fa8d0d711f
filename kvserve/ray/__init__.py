"""kvserve on Ray Serve: replicas of kvserve engines behind Serve's proxy, routed exactly.

`serve run kvserve.ray:app model=... num_replicas=4` (or a Serve config file with
`import_path: kvserve.ray:app`). The only part of kvserve that imports Ray (the optional
extra `kvserve[ray]`); README "Several machines: Ray Serve", docs/several-engines.md.
"""

from kvserve.ray.app import app, build_app

__all__ = ["app", "build_app"]
