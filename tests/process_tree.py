"""A driver process and what it started: found by pid and killed the hard way, for the tests and benchmarks that
SIGKILL a `raysweep tune` (tests/test_resilience.py, benchmarks/soak.py)."""

from __future__ import annotations

import subprocess
import time


def descendants(pid: int) -> list:
    """Every live process below `pid` (psutil.Process objects), or none if `pid` is gone."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def sigkill_driver(driver: subprocess.Popen) -> None:
    """SIGKILL the driver, then what it started, by pid.

    A SIGKILLed driver's local cluster left its DashboardAgent and RuntimeEnvAgent running here, reparented to
    init. Ray's agents are meant to exit when their raylet does (python/ray/_private/process_watcher.py in Ray);
    ray #52385 (open) reports an agent that outlived its raylet. The tree is listed before the kill, while the
    driver is still their ancestor."""
    import psutil

    tree = descendants(driver.pid)
    driver.kill()
    driver.wait(timeout=60)
    time.sleep(1)
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
