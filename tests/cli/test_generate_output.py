"""`kvserve generate` prints each completion when it finishes, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kvserve.cli.generate import _Printer
from kvserve.outputs import CompletionOutput, RequestOutput


def test_sigint_keeps_what_finished_and_exits_130(demo_path):
    # One request at a time: the first finishes long before the last.
    cmd = [sys.executable, "-m", "kvserve.cli", "generate", "--model", demo_path]
    cmd += ["--no-progress", "--max-num-seqs", "1", "--num-kv-blocks", "64"]
    cmd += ["--max-tokens", "48", "--ignore-eos"]
    for i in range(60):
        cmd += ["--prompt", f"Question {i}: what comes next?"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        seen = []
        while not (seen and seen[-1].startswith("  ")):  # a completion line
            line = proc.stdout.readline()
            assert line, f"exited before a completion: {proc.wait()} {proc.stderr.read()}"
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen) + out
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    notes = [line for line in err.splitlines() if not line.startswith("INFO ")]
    assert len(notes) == 1 and "interrupted" in notes[0], err
    printed = out.count("prompt: ")
    assert 1 <= printed < 60
    assert f"{printed} of 60 prompts finished" in notes[0]
    assert "prompt: 'Question 0: what comes next?'" in out
    assert "(length)" in out.split("prompt: 'Question 0")[1].splitlines()[1]
    assert "requests:" not in out  # no summary of a run that did not end


def _output(i: int) -> RequestOutput:
    done = CompletionOutput(0, f"answer {i}", [i], "length")
    return RequestOutput(str(i), f"q{i}", [i], [done], finished=True)


def test_in_order_holds_a_completion_until_the_earlier_ones_are_printed(capsys):
    shown = ["q0", "q1", "q2", "q3"]
    printer = _Printer(shown, in_order=True)
    printer(2, _output(2))
    printer(1, _output(1))
    assert capsys.readouterr().out == ""  # prompt 0 is still running
    printer(0, _output(0))
    out = capsys.readouterr().out
    assert out.index("'q0'") < out.index("'q1'") < out.index("'q2'")
    printer.flush()
    assert capsys.readouterr().out == ""
    printer = _Printer(shown, in_order=False)  # the default: as each finishes
    printer(3, _output(3))
    assert capsys.readouterr().out == "prompt: 'q3'\n  'answer 3'  (length)\n"
    stopped = _Printer(shown, in_order=True)
    stopped(3, _output(3))
    stopped(1, _output(1))
    stopped.flush()  # Ctrl-C: the finished ones are printed, still in prompt order
    out = capsys.readouterr().out
    assert out.index("'q1'") < out.index("'q3'") and stopped.printed == 2
