"""Keep a local Ray's control plane out of the way of the forwards it serves.

On a small CPU box the target's forward runs one OpenMP thread per core, and
a forward stalls whenever one of its threads is preempted: each wake-up of
another process costs the whole forward about as long as that process runs,
and an idle Ray + Serve wakes thousands of times a second over ten processes
(docs/benchmarks.md, served against in-process). For the local Ray that
`specserve serve` and the benches start (never a cluster joined with --address):

1. `quiet_env` (before `ray.init`): Ray's and Serve's 0.1-0.25 s periodic
   work every second instead (`QUIET_ENV`), and no idle worker processes
   kept around. Values set in the environment win. Costs: resource and
   memory reports, the Serve controller's reconciliation and the OOM
   monitor react within a second instead of 0.1-0.25 s; a new worker's
   log lines reach the console up to 5 s late; node metrics (CPU, memory
   per process) are refreshed every 15 s and task events every 5 s; a
   plain Ray task starts a fresh worker process (specserve runs actors).
   What is left is mostly every Python worker's hard-coded 10 ms signal check.
2. `yield_control_plane` (after the application is up): the control plane's
   processes (GCS, raylet, agents, log monitor, Serve controller, idle
   workers, and the driver that started them) go to SCHED_BATCH. They keep
   their full share of the CPU, but their wake-ups no longer preempt a
   running thread; they run when the current one's slice ends. The request
   path (Serve proxy and replicas, coordinator, workers) stays SCHED_OTHER.
3. `data_plane_priority` (in each specserve actor's constructor): a worker
   process the raylet starts later (a restart) inherits the raylet's
   SCHED_BATCH; ours put themselves back.

All of it is Linux-only and best effort: elsewhere, or where the kernel
refuses, nothing changes.
"""

from __future__ import annotations

import os
import pathlib

QUIET_ENV = {
    # raylet: resource reports to the GCS, GC and disk checks, OOM monitor, idle-worker reaping (0.1-0.25 s)
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_raylet_check_gc_period_milliseconds": "1000",
    "RAY_object_manager_timer_freq_ms": "1000",
    "RAY_local_fs_monitor_interval_ms": "1000",
    "RAY_memory_monitor_refresh_ms": "1000",
    "RAY_kill_idle_workers_interval_ms": "1000",
    # no pool of idle Python workers, each waking 100 times a second
    "RAY_prestart_worker_first_driver": "false",
    "RAY_num_workers_soft_limit": "0",
    # the log monitor: its scan of the log directory for new files every 5 s. Below
    # RAY_LOG_MONITOR_MANY_FILES_THRESHOLD files (1,000) it ignores the interval and globs the directory on
    # every 0.1 s pass
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    # Serve: the controller's loop (0.1 s; each pass asks the GCS for every node, its resource usage and the
    # draining nodes; at 1 s `specserve serve` came up seconds later) and the
    # replicas' and proxies' metric caches (0.1 s; Ray exports metrics every 10 s anyway)
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # the dashboard agent's node report (psutil over every worker process; 5 s) and every worker's flush of
    # its task events to the GCS (1 s; they feed `ray list tasks` and the dashboard, which specserve does not use)
    "REPORTER_UPDATE_INTERVAL_MS": "15000",
    "RAY_task_events_report_interval_ms": "5000",
}

# Ray worker processes (cmdline "ray::<actor or task>") that are control plane, not request path
_CONTROL_WORKERS = ("ray::ServeController", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE")


def quiet_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Put `QUIET_ENV` into the environment where it has no value yet; returns what was set."""
    environ = os.environ if environ is None else environ
    applied = {key: value for key, value in QUIET_ENV.items() if key not in environ}
    environ.update(applied)
    return applied


def _supported() -> bool:
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH") and pathlib.Path("/proc/self/task").is_dir()


def _set_policy(pid: int, policy: int) -> bool:
    """Every thread of process `pid` to `policy`; whether any had another one (threads gone or not ours are
    skipped)."""
    changed = False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) != policy:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                changed = True
        except OSError:  # the thread ended, or the kernel says no
            continue
    return changed


def cmdline(pid: int) -> str:
    """Process `pid`'s command line, its arguments joined by spaces ("" for a process gone or not readable)."""
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """The pids of every process under `root` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def is_control_plane(cmdline: str) -> bool:
    """Whether a process of a local Ray is control plane (not on the request path), by its command line."""
    if not cmdline.startswith("ray::"):
        return True  # gcs_server, raylet, log monitor, dashboard, ...: not a worker
    return cmdline.startswith(_CONTROL_WORKERS)


def yield_control_plane(root: int | None = None, include_root: bool = True) -> list[int]:
    """SCHED_BATCH for the control-plane processes under `root` (default: this process, the driver that
    started the local Ray) and, with include_root, `root` itself. Returns the pids that were not at it yet."""
    if not _supported():
        return []
    root = os.getpid() if root is None else root
    pids = [pid for pid in descendants(root) if is_control_plane(cmdline(pid))]
    if include_root:
        pids.append(root)
    return [pid for pid in pids if _set_policy(pid, os.SCHED_BATCH)]


def data_plane_priority() -> bool:
    """Back to SCHED_OTHER for every thread of this process (if a SCHED_BATCH raylet started it); whether any
    thread changed."""
    return _supported() and _set_policy(os.getpid(), os.SCHED_OTHER)
