"""Running the book on a Ray cluster (`circuitbook build --ray [ADDRESS]`).

Ray is imported only here and only when a build or a notebook asks for it: without `--ray`
nothing in this module runs. Two things go to the cluster:

- notebooks: each notebook whose inputs are ready (the notebooks it `needs` are done) runs as a
  Ray task asking for the resources its profiles.yml declares (`resources:`), executed with
  papermill on whichever node has them; its executed notebook comes back to the build, which
  caches and renders it exactly as a local build does;
- parts of runs: a notebook executing under a Ray build gets $CIRCUITBOOK_RAY_ADDRESS, and a run
  that `train()` splits into chunks of members offers every chunk to the cluster as a task (the
  notebook's process trains chunks too; whoever claims a chunk's lock trains it).

Every node must see the same run store ($CIRCUITBOOK_RUNS on a shared filesystem) and the
checkout at the same path ($CIRCUITBOOK_ROOT), with the same Python environment.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

from . import execute, settings
from .execute import BuildError
from .training.chunks import train_part_if_free, use_scheduler

ADDRESS_ENV = "CIRCUITBOOK_RAY_ADDRESS"  # set for a notebook's kernel by a Ray build
RESOURCES_ENV = "CIRCUITBOOK_RAY_RESOURCES"  # JSON: the resources of that notebook's tasks
DEFAULT_RESOURCES = {"num_cpus": 1}
# a part sent to another node: a fresh Ray worker process, its imports, its first evaluation and files (measured
# 13.9 s per task by benchmarks/cluster.py on a 2-core machine; what a part's ensemble costs is measured on the spot)
TASK_OVERHEAD_S = 14.0
CONNECT_TIMEOUT_S = 5.0
PASS_ENV = tuple(name for name, s in settings.SETTINGS.items() if not s.internal)  # what a node's tasks inherit


class ClusterError(BuildError):
    """The Ray cluster cannot be used (Ray missing, address unreachable)."""


def active() -> bool:
    """True in a process that a Ray build asked to send work to the cluster."""
    return settings.ray_build()


def _ray():
    try:
        import ray
    except ImportError:
        raise ClusterError("--ray needs Ray, an optional extra: pip install -e '.[ray]'") from None
    return ray


def check_reachable(address: str) -> None:
    """A clear error, before any compute, when HOST:PORT does not answer."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"--ray {address!r}: expected HOST:PORT of a Ray cluster's head (e.g. 10.0.0.5:6379), "
                           "or no address to use the cluster started on this machine")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterError(f"cannot reach the Ray cluster at {address} ({e.strerror or e}); start one with "
                           "`ray start --head` (then `ray start --address HEAD:6379` on each worker) or pass the "
                           "address of a running cluster") from None


def connect(address: str | None = None) -> str:
    """Join the cluster at `address` (None/auto: $RAY_ADDRESS, else the one started on this machine,
    else a new local one); return the address notebooks and tasks use to join it."""
    ray = _ray()
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if address != "auto" and not address.startswith("ray://"):
        check_reachable(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs = dict(namespace="circuitbook", log_to_driver=False, logging_level="ERROR",
                  configure_logging=True, include_dashboard=False)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError:
        if address != "auto":
            raise ClusterError(f"cannot join the Ray cluster at {address}") from None
        ray.init(**kwargs)  # no cluster on this machine: a local one (a laptop)
    except Exception as e:  # noqa: BLE001 - Ray raises many kinds; one line says which
        raise ClusterError(f"cannot join the Ray cluster at {address}: {type(e).__name__}: {e}") from None
    # kernels and tasks join by the address the user gave (e.g. loopback); found ones by Ray's own
    return address if address not in ("auto",) else ray.get_runtime_context().gcs_address


def _join_from_env():
    ray = _ray()
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=os.environ[ADDRESS_ENV], namespace="circuitbook", log_to_driver=False,
                 logging_level="ERROR", include_dashboard=False)
    return ray


def task_resources() -> dict:
    """The resources each part of this notebook's runs asks for (its notebook's declaration)."""
    return json.loads(os.environ.get(RESOURCES_ENV) or "null") or dict(DEFAULT_RESOURCES)


def ray_options(resources: dict) -> dict:
    """profiles.yml's resource names -> Ray's task options."""
    out = {"num_cpus": resources.get("num_cpus", 1), "num_gpus": resources.get("num_gpus", 0)}
    if resources.get("memory_gb"):
        out["memory"] = int(resources["memory_gb"] * 2 ** 30)
    return out


def worker_slots() -> int:
    """How many parts can train at once on the cluster (its CPUs or GPUs over what one part asks for)."""
    ray = _join_from_env()
    total = ray.cluster_resources()
    opts = ray_options(task_resources())
    if opts["num_gpus"]:
        return max(1, int(total.get("GPU", 0) // opts["num_gpus"]))
    return max(1, int(total.get("CPU", 1) // max(opts["num_cpus"], 1e-9)))


class RemoteParts:
    """The Ray tasks offered for a run's parts; `close()` cancels those not yet started."""

    def __init__(self, refs: list):
        self.refs = refs

    def close(self) -> None:
        ray = _ray()
        for ref in self.refs:
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - already finished or gone
                pass


class RayParts:
    """The part scheduler of a notebook that a Ray build executes (`training.chunks.use_scheduler`): every
    part of a split run is also offered to the cluster as a task, and the cluster's free slots count as
    workers when the chunk size is chosen."""

    task_overhead_s = TASK_OVERHEAD_S

    def workers(self) -> int:
        return worker_slots()

    def submit(self, spec, bounds) -> RemoteParts:
        ray = _join_from_env()
        task = ray.remote(train_part_if_free).options(**ray_options(task_resources()), max_retries=3)
        return RemoteParts([task.remote(spec, lo, hi) for lo, hi in bounds])


def install_part_scheduler() -> None:
    """In a process that a Ray build asked to send work to the cluster ($CIRCUITBOOK_RAY_ADDRESS), make
    `train()` offer the parts of split runs to it (called by `load_params`)."""
    if active():
        use_scheduler(RayParts())


# ---------------------------------------------------------------- notebooks as tasks

def _execute_task(nb, profile: str, label: str, env: dict) -> dict:
    """Run on a node: execute one notebook with papermill; return its executed bytes and seconds."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory(prefix="circuitbook-nb-") as tmp:
            dest = Path(tmp) / Path(nb.path).name
            try:
                seconds = execute.execute(nb, profile, dest, log=lambda m: None, label=label)
                return {"ok": True, "seconds": seconds, "notebook": dest.read_bytes(), "node": socket.gethostname()}
            except execute.BuildError as e:
                return {"ok": False, "error": str(e), "notebook": dest.read_bytes() if dest.exists() else None}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def execute_notebooks(todo: list, profile: str, address: str, resources_of, on_done, keep_going: bool, log) -> None:
    """Execute `todo` (Notebook objects, in _toc.yml order) on the cluster, each once the notebooks
    it needs have finished; `on_done(nb, result)` is called as each finishes (it raises to stop)."""
    ray = _ray()
    base_env = {k: os.environ[k] for k in PASS_ENV if os.environ.get(k)}
    base_env[ADDRESS_ENV] = address
    task = ray.remote(_execute_task)
    pending, running, done = list(todo), {}, set()
    waiting_on = {nb.label for nb in todo}
    total, started = len(todo), 0
    try:
        while pending or running:
            for nb in [nb for nb in pending if all(n not in waiting_on or n in done for n in nb.needs)]:
                resources = resources_of(nb)
                env = {**base_env, RESOURCES_ENV: json.dumps(resources)}
                ref = task.options(**ray_options(resources), max_retries=2).remote(nb, profile, profile, env)
                running[ref] = nb
                pending.remove(nb)
                started += 1
                log(f"[{started}/{total}] {nb.path}: "
                    f"executing as a Ray task ({', '.join(f'{k}={v}' for k, v in resources.items())}) ...")
            ready, _ = ray.wait(list(running), num_returns=1)
            for ref in ready:
                nb = running.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the task itself died (its node went away, ...)
                    result = {"ok": False, "error": f"notebook {nb.path}: its Ray task failed: {type(e).__name__}: "
                                                    f"{str(e).splitlines()[0] if str(e) else ''}", "notebook": None}
                done.add(nb.label)
                on_done(nb, result)
    except BaseException:
        for ref in running:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001
                pass
        raise
