"""`workers.quiet`: a local Ray's periodic work slowed, its control plane at SCHED_BATCH, the request path not."""

import os
import subprocess
import sys
import time

import pytest

from specserve.workers.quiet import QUIET_ENV, descendants, is_control_plane, quiet_env, yield_control_plane

linux = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
                           reason="scheduling policies are Linux's")


def test_quiet_env_fills_in_only_what_the_user_left_unset():
    environ = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "PATH": "/bin"}
    applied = quiet_env(environ)
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in applied
    assert environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"  # the user's value wins
    assert environ["RAY_raylet_report_resources_period_milliseconds"] == "1000"
    assert set(applied) == set(QUIET_ENV) - {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S"}
    assert quiet_env(environ) == {}  # a second call changes nothing


@pytest.mark.parametrize("cmdline, control", [
    ("/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray", True),
    ("/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", True),
    ("python3 -u /site-packages/ray/_private/log_monitor.py", True),
    ("ray::ServeController.listen_for_change", True),
    ("ray::DashboardAgent", True),
    ("ray::IDLE", True),
    ("ray::ProxyActor", False),
    ("ray::ServeReplica:specserve:SpecServe", False),
    ("ray::Coordinator.generate", False),
    ("ray::TargetWorkerActor", False),
    ("ray::DraftWorkerActor", False),
])
def test_processes_are_told_apart_by_their_command_line(cmdline, control):
    assert is_control_plane(cmdline) is control


@linux
def test_the_control_plane_goes_to_batch_and_the_request_path_stays():
    # a stand-in tree: a root (as the driver) over a daemon, a control-plane worker and two request-path workers
    script = ("sleep 60 & exec -a ray::ServeController sleep 60 & exec -a ray::TargetWorkerActor sleep 60 & "
              "exec -a ray::ProxyActor sleep 60 & wait")
    root = subprocess.Popen(["bash", "-c", script])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(root.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = descendants(root.pid)
        assert len(kids) == 4
        changed = yield_control_plane(root.pid)
        names = {pid: open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode() for pid in kids}
        policy = {names[pid]: os.sched_getscheduler(pid) for pid in kids}
        assert policy["sleep"] == os.SCHED_BATCH
        assert policy["ray::ServeController"] == os.SCHED_BATCH
        assert policy["ray::TargetWorkerActor"] == os.SCHED_OTHER
        assert policy["ray::ProxyActor"] == os.SCHED_OTHER
        assert os.sched_getscheduler(root.pid) == os.SCHED_BATCH  # the root (driver) too, unless told not to
        assert sorted(changed) == sorted([root.pid] + [p for p in kids if names[p] in ("sleep", "ray::ServeController")])
    finally:
        for pid in descendants(root.pid):
            os.kill(pid, 9)
        root.kill()
        root.wait()


@linux
def test_a_worker_started_under_batch_puts_itself_back_on_the_request_path():
    code = ("import os, threading, time\n"
            "from specserve.workers.quiet import data_plane_priority\n"
            "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"  # a thread that existed before
            "assert os.sched_getscheduler(0) == os.SCHED_BATCH\n"
            "print(data_plane_priority(), data_plane_priority())\n"
            "print(sorted({os.sched_getscheduler(int(tid)) for tid in os.listdir('/proc/self/task')}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)))
    assert out.returncode == 0, out.stderr
    first, policies = out.stdout.splitlines()
    assert first == "True False"  # changed once; a second call finds nothing to do
    assert policies == str([os.SCHED_OTHER])  # every thread, the one started before included
