"""Routing across engines: which replica gets a request (pure Python, plain numbers).

The caller predicts each replica's prefix hit from its KV events
(`kvserve.events.index.PrefixIndex`) and keeps each replica's load; a policy
only decides (`kvserve.routing.policy`).
"""

from kvserve.routing.policy import (
    POLICIES,
    Choice,
    Policy,
    ReplicaLoad,
    make_policy,
)

__all__ = ["POLICIES", "Choice", "Policy", "ReplicaLoad", "make_policy"]
