"""A two-node Ray cluster on this machine for tests: loopback, one CPU per node, small object store.

Every process it starts is found by its session folder (a fresh temp dir) or as a descendant of one,
and is ended by pid: nothing else running Ray on the machine is touched.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")
# Said explicitly for every process of the cluster and its drivers. Left unset, Ray decides per process: a head
# started by `ray start --head` turns token authentication on when ~/.ray/auth_token exists (any local `ray.init()`
# writes one), a node joining by `ray start --address` does not, and the GCS refuses it ("InvalidAuthToken",
# CI 2026-12-05: the cluster did not start in 3 attempts).
AUTH = {"RAY_AUTH_MODE": "disabled"}
NODE = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=80000000", "--disable-usage-stats"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, tuple[int, str]]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                out[int(d.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)
            except (OSError, IndexError, ValueError):
                pass
    return out


def _with_descendants(roots: set[int], procs: dict) -> set[int]:
    found, grew = set(roots), True
    while grew:
        grew = False
        for pid, (ppid, _) in procs.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found


class LocalCluster:
    def __init__(self):
        self._new_session()
        self.env = {**os.environ, **AUTH, "RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}

    def start(self, attempts: int = 3) -> "LocalCluster":
        """Head, then the worker node. A start that fails (CI once saw the worker's `ray start --address`
        exit 1, its output not shown) is stopped by pid and tried again on a fresh port
        and session folder; the last failure is raised with Ray's own output and log tails, so it can be
        diagnosed."""
        for attempt in range(1, attempts + 1):
            try:
                self._start_once()
                return self
            except subprocess.SubprocessError as e:
                report = self._failure_report(e)
                self.stop()
                if attempt == attempts:
                    raise RuntimeError(f"local Ray cluster did not start in {attempts} attempts; last:\n{report}") from e
                print(f"local Ray cluster start failed (attempt {attempt}), retrying:\n{report}", file=sys.stderr)
                self._new_session()
            except BaseException:
                self.stop()
                raise

    def _new_session(self) -> None:
        self.temp = tempfile.mkdtemp(prefix="cbray", dir="/tmp")  # short: Ray's socket paths must fit
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def _start_once(self) -> None:
        subprocess.run([RAY, "start", "--head", f"--port={self.port}", "--include-dashboard=false",
                        f"--temp-dir={self.temp}", *NODE], env=self.env, check=True, timeout=300,
                       capture_output=True)
        subprocess.run([RAY, "start", f"--address={self.address}", *NODE, '--resources={"cb_worker_node": 1}'],
                       env=self.env, check=True, timeout=300, capture_output=True)

    def _failure_report(self, e: subprocess.SubprocessError, tail: int = 1500) -> str:
        def text(b):
            return (b.decode(errors="replace") if isinstance(b, bytes) else b or "")[-tail:]
        lines = [f"command: {' '.join(map(str, getattr(e, 'cmd', '') or []))}",
                 f"stdout: {text(getattr(e, 'stdout', None))}", f"stderr: {text(getattr(e, 'stderr', None))}"]
        for log in sorted(Path(self.temp).glob("session_*/logs/*")):
            if log.is_file() and log.suffix in (".out", ".err", ".log") and log.stat().st_size:
                if any(k in log.name for k in ("raylet", "gcs_server", "monitor")):
                    lines.append(f"{log.name}: {log.read_text(errors='replace')[-tail:]}")
        return "\n".join(lines)

    def _mine(self) -> set[int]:
        procs = _processes()
        roots = {pid for pid, (_, cmd) in procs.items() if self.temp in cmd and pid != os.getpid()}
        return _with_descendants(roots, procs) - {os.getpid()}

    def worker_node_pids(self) -> set[int]:
        """The second node's raylet (its socket is raylet.1) and everything under it (its workers)."""
        procs = _processes()
        roots = {pid for pid, (_, cmd) in procs.items() if self.temp in cmd and "sockets/raylet.1" in cmd
                 and "/raylet/raylet" in cmd}
        return _with_descendants(roots, procs)

    def kill_worker_node(self) -> set[int]:
        pids = self.worker_node_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, every process of this cluster (found before any dies, so that orphans
        re-parented to init are still known)."""
        pids = self._mine()
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            pids |= self._mine()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait
            while time.time() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
                time.sleep(0.2)
