"""The event follower's thread outlives callers that gave up on it (a timed-out request)."""

from __future__ import annotations

from kvserve.router.follower import EventFollower


def test_a_cancelled_sync_or_prediction_does_not_stop_the_thread():
    follower = EventFollower()
    gave_up = [follower.sync(), follower.predict([[1, 2, 3]], {}), follower.predict([[4]], {})]
    for future in gave_up:
        assert future.cancel()  # queued before the thread runs: certainly not answered yet
    follower.start()
    try:
        assert follower.sync().result(timeout=5) == frozenset()  # nothing followed yet
        assert follower.predict([[1, 2, 3]], {}).result(timeout=5) == {}
        assert follower.predict([[1, 2, 3]], {}, frozenset({0})).result(timeout=5) == {}
    finally:
        follower.close()
