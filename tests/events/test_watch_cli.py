"""`kvserve events` with no engine there: it says so once, then waits or stops per --duration."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def events(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "events", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_no_engine_within_duration_is_one_line_and_status_2(ports):
    proc = events("--connect", ports.connect, "--replay", ports.replay_connect, "--duration", "1.5")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith("kvserve events: error: no engine answered at ")
    assert ports.replay_connect in line  # the endpoint it asked
    assert out.count("waiting for an engine") == 1, out


def test_without_duration_it_keeps_waiting_until_interrupted(ports):
    proc = events("--connect", ports.connect)  # the replay endpoint: the port + 1
    try:
        time.sleep(3.5)  # three replay requests time out meanwhile
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (out, err)
    assert "Traceback" not in err and not err.strip(), err
    assert out.count("waiting for an engine") == 1, out
