"""A finding's smallest workload: fewer requests, shorter prompts and outputs, fewer options.

Greedy delta debugging: try one smaller variant at a time and keep it when
the same kind of finding still shows, until no variant keeps it or time runs
out. Plain code over our own workload type; Hypothesis shrinks only what its
own strategies drew, and a workload's runs are too long to replay through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

from tests.fuzz.differential import References, run_workload
from tests.fuzz.workloads import FuzzRequest, Workload

DEFAULTS = {"max_num_batched_tokens": 2048, "max_num_seqs": 16}
"""Options a variant sets back to an easy value (offload and drafts it drops)."""


def _variants(w: Workload) -> Iterator[Workload]:
    reqs = w.requests
    for i in range(len(reqs)):
        if len(reqs) > 1:
            yield replace(w, requests=reqs[:i] + reqs[i + 1 :])
    for name in ("offload", "speculative_config"):
        if name in w.options:
            yield replace(w, options={k: v for k, v in w.options.items() if k != name})
    for name, easy in DEFAULTS.items():
        if w.options.get(name) != easy:
            yield replace(w, options={**w.options, name: easy})

    def with_request(i: int, r: FuzzRequest) -> Workload:
        return replace(w, requests=[*reqs[:i], r, *reqs[i + 1 :]])

    for i, r in enumerate(reqs):
        if r.abort_at is not None:
            yield with_request(i, replace(r, abort_at=None))
        if r.arrival:
            yield with_request(i, replace(r, arrival=0))
        if r.n > 1:
            yield with_request(i, replace(r, n=r.n - 1))
        if r.max_tokens > 1:
            yield with_request(i, replace(r, max_tokens=max(1, r.max_tokens // 2)))
            yield with_request(i, replace(r, max_tokens=r.max_tokens - 1))
        if len(r.prompt) > 1:
            yield with_request(i, replace(r, prompt=r.prompt[: len(r.prompt) // 2]))
            yield with_request(i, replace(r, prompt=r.prompt[:-1]))
            yield with_request(i, replace(r, prompt=r.prompt[1:]))


def shrink(workload: Workload, kind: str, references: References, seconds: float) -> Workload:
    """The smallest variant of `workload` found in `seconds` that still shows `kind`."""
    deadline = time.monotonic() + seconds

    def shows(w: Workload) -> bool:
        try:
            return any(f.kind == kind for f in run_workload(w, references))
        except ValueError:  # a variant the engine refuses to build (e.g. a tier too small)
            return False

    progress = True
    while progress and time.monotonic() < deadline:
        progress = False
        for variant in _variants(workload):
            if time.monotonic() >= deadline:
                break
            if shows(variant):
                workload = variant
                progress = True
                break
    return workload
