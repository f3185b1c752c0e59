"""Lease locks on the run store: exclusive across processes, taken over from dead holders only."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from circuitbook.runs import LeaseLock, LockLost, _host_id

HOLD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from circuitbook.runs import LeaseLock
    lock, log, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    for _ in range(rounds):
        with LeaseLock(lock, lease=float(sys.argv[4])).hold():
            with open(log, "a") as f:
                f.write(json.dumps(["in", time.time()]) + "\\n")
            time.sleep(0.05)
            with open(log, "a") as f:
                f.write(json.dumps(["out", time.time()]) + "\\n")
    """)


def test_processes_never_hold_the_lock_at_once(tmp_path):
    lock, log = tmp_path / "run.lock", tmp_path / "log.jsonl"
    # The script is written once, before any process starts: rewriting it for each start truncated it under
    # a process still reading it, which then ran an empty script and exited 0 with no rounds (CI, stop 28).
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    procs = [subprocess.Popen([sys.executable, str(script), *map(str, (lock, log, 8, 30))]) for _ in range(3)]
    assert all(p.wait(120) == 0 for p in procs)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(events) == 2 * 3 * 8, "every process logs each of its 8 rounds"
    depth = 0
    for kind, _ in events:  # appended in the order they happened: strictly in, out, in, out, ...
        depth += 1 if kind == "in" else -1
        assert depth in (0, 1), "two processes held the lock at once"
    assert not list(tmp_path.glob("run.lock.*")), "released locks leave no file"


def test_a_killed_holder_on_this_host_is_taken_over_at_once(tmp_path):
    lock = tmp_path / "run.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from circuitbook.runs import LeaseLock
        LeaseLock({str(lock)!r}, lease=3600).acquire()
        print("held", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    waiter = LeaseLock(lock, lease=3600)
    assert not waiter.try_acquire(), "a live holder keeps its lock"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    t0 = time.monotonic()
    waiter.acquire(timeout=10)
    assert time.monotonic() - t0 < 5, "a dead holder on this host is seen at once, not after the lease"
    waiter.release()


def test_a_holder_on_another_host_is_trusted_while_its_heartbeat_moves(tmp_path):
    lock = tmp_path / "run.lock"
    gen = tmp_path / "run.lock.0"
    gen.write_text(json.dumps({"host": "elsewhere/boot", "pid": 1, "start": "0", "token": "x"}))
    waiter, watch = LeaseLock(lock, lease=0.6), {}
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:  # the other host keeps touching its file: never stale
        os.utime(gen, ns=(time.time_ns(), time.time_ns() + int((time.monotonic() - t0) * 1e9)))
        assert not waiter.try_acquire(watch)
        time.sleep(0.1)
    t1 = time.monotonic()
    while not waiter.try_acquire(watch):  # its heartbeat stops: taken over after the lease
        time.sleep(0.05)
    assert 0.5 <= time.monotonic() - t1 < 3
    assert waiter.mine.name == "run.lock.1" and not gen.exists()
    waiter.release()


def test_a_paused_holder_learns_it_lost_the_lock(tmp_path):
    lock = tmp_path / "run.lock"
    a = LeaseLock(lock, lease=0.5)
    a.acquire()
    a._stop.set()  # its heartbeat stops (a paused process)
    a._beat.join()
    info = json.loads(a.mine.read_text())
    a.mine.write_text(json.dumps({**info, "host": "elsewhere/boot"}))  # so that only the lease can end it
    b = LeaseLock(lock, lease=0.5)
    b.acquire(timeout=10)
    with pytest.raises(LockLost, match="taken over"):
        a.check()
    b.check()
    a.release()  # releasing a lost lock leaves the new holder's file alone
    assert b.holds()
    b.release()


def test_host_id_names_the_boot():
    host = _host_id()
    assert "/" in host and len(host.split("/", 1)[1]) > 10
