"""Whether the float32 kernels may run on this thread now: inside the step of a float32
runner that is not exact.

The kernels are process-wide, but float32's choice is per engine: an exact engine
(`--exact`, $KVSERVE_EXACT) must keep torch's ops and their bits, and another engine
of the same process may be fast. So a fast float32 runner opens this scope around its
step (kvserve.model.cpu_kernels.switch), and the kernels' float32 paths look it up
per call. Outside any scope float32 keeps torch's ops. Per thread: engines stepping
in threads of one process each set their own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Scope(threading.local):
    on: bool = False


_SCOPE = _Scope()


def float32_on() -> bool:
    """Whether this thread is inside a fast float32 runner's step."""
    return _SCOPE.on


@contextmanager
def float32_kernels(on: bool) -> Iterator[None]:
    """Within: the float32 kernels run on this thread if `on`, torch's ops if not."""
    saved, _SCOPE.on = _SCOPE.on, on
    try:
        yield
    finally:
        _SCOPE.on = saved
