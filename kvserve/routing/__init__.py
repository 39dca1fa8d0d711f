"""Routing policies: which replica gets a request, from plain numbers (hits, loads).

Pure Python: never imports torch, FastAPI, zmq or the model room. The caller
(the live router, or simulate) predicts each replica's prefix hit and keeps
its load; a policy only decides.
"""

from kvserve.routing.policy import POLICIES, Choice, Policy, ReplicaLoad, make_policy

__all__ = ["POLICIES", "Choice", "Policy", "ReplicaLoad", "make_policy"]
