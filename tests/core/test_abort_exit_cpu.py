"""The process-wide abort watcher (yali_vllm.communicator), without a GPU: when it ends the
process, and that it does, with one log line and ABORT_EXIT_CODE, or leaves it be once YaliError
was raised. The record is read through a stand-in for the host-mapped abort record;
tests/gpu/test_abort_exit.py runs the watcher on real aborts."""
import logging
import subprocess
import sys
import textwrap
import time

import pytest

from yali_vllm import communicator as c
from yali_vllm import config

GRACE = c.ABORT_EXIT_GRACE_S


@pytest.mark.parametrize("seen_at,now,raised,due", [
    (None, 1000.0, False, False),  # no abort
    (100.0, 100.0, False, False),  # just seen
    (100.0, 100.0 + GRACE - 0.01, False, False),  # the grace not over
    (100.0, 100.0 + GRACE, False, True),  # over: the process ends
    (100.0, 100.0 + 10 * GRACE, False, True),
    (100.0, 100.0 + GRACE, True, False),  # YaliError reached the caller
    (100.0, 100.0 + 10 * GRACE, True, False),
])
def test_abort_exit_decision(seen_at, now, raised, due):
    assert c.abort_exit_due(seen_at, now, raised) is due


def test_the_grace_is_a_bounded_few_seconds():
    assert 1.0 <= GRACE <= 30.0 and c.ABORT_POLL_S <= 1.0 and c.ABORT_EXIT_CODE != 0


def test_the_setting_is_known_and_read_as_a_flag():
    assert config.ABORT_EXIT_VAR == "YALI_ABORT_EXIT" and config.ABORT_EXIT_VAR in config.SETTINGS
    config.check_environment({config.ABORT_EXIT_VAR: "0"})  # accepted, not an unknown YALI_* name
    assert config.env_flag(config.ABORT_EXIT_VAR, True, {}) is True
    assert config.env_flag(config.ABORT_EXIT_VAR, True, {config.ABORT_EXIT_VAR: "0"}) is False
    with pytest.raises(ValueError, match="YALI_ABORT_EXIT"):
        config.env_flag(config.ABORT_EXIT_VAR, True, {config.ABORT_EXIT_VAR: "maybe"})


def test_a_record_is_logged_once_and_the_thread_lives_with_its_communicators(caplog):
    records = {7: "", 8: ""}
    w = c._AbortWatcher(grace_s=GRACE, read=lambda h: records[h])
    w.add(7, 0, end_process=False)
    w.add(8, 1, end_process=True)
    assert w.watching()
    with caplog.at_level(logging.ERROR, logger="yali_vllm"):
        w.poll(100.0)
        records[7] = "yali: rank 0 flash-push kernel, block 3, gave up"
        w.poll(101.0)
        w.poll(101.0 + 10 * GRACE)  # handle 7 does not end the process (end_process=False)
    assert [r.getMessage() for r in caplog.records] == ["YALI error: yali: rank 0 flash-push kernel, block 3, gave up"]
    w.remove(7)
    assert w.watching()
    w.remove(8)
    assert not w.watching()  # the last communicator closed: the thread stopped
    w.add(9, 0, end_process=False)
    assert w.watching()
    w.remove(9)


CHILD = textwrap.dedent("""
    import sys, time
    from yali_vllm import communicator as c
    w = c._AbortWatcher(grace_s={grace}, read=lambda h: "yali: rank 3 flash-push kernel, block 0: the ranks issued "
                                                          "different calls (...)")
    print(time.time(), flush=True)
    w.add(5, 3, end_process=True)
    if {raised}:
        w.note_raised(5)
    time.sleep({stay})
    print("still here", flush=True)
""")


def _child(grace: float, raised: bool, stay: float) -> tuple[subprocess.CompletedProcess, float]:
    proc = subprocess.run([sys.executable, "-c", CHILD.format(grace=grace, raised=raised, stay=stay)],
                          capture_output=True, text=True, timeout=120)
    return proc, time.time()


def test_the_watcher_ends_a_process_whose_abort_reached_no_caller():
    grace = 1.0
    proc, ended = _child(grace, raised=False, stay=30)
    assert proc.returncode == c.ABORT_EXIT_CODE, (proc.returncode, proc.stderr)
    started = float(proc.stdout.split()[0])
    assert "still here" not in proc.stdout
    assert ended - started < grace + 3 * c.ABORT_POLL_S + 2.0, ended - started
    lines = [ln for ln in proc.stderr.splitlines() if "ends this process" in ln]
    assert len(lines) == 1, proc.stderr
    assert (f"yali: rank 3 ends this process (exit code {c.ABORT_EXIT_CODE}): a YALI kernel gave up" in lines[0]
            and "YALI_ABORT_EXIT=0 keeps the process" in lines[0] and "the ranks issued different calls" in lines[0]), lines
    assert "YALI error: yali: rank 3 flash-push kernel" in proc.stderr


def test_the_watcher_leaves_a_process_that_raised_yali_error():
    proc, _ = _child(0.5, raised=True, stay=2.0)
    assert proc.returncode == 0 and "still here" in proc.stdout, (proc.returncode, proc.stderr)
    assert "YALI error:" in proc.stderr and "ends this process" not in proc.stderr
