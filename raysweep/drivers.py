"""Where a sweep's driver lives, and whether it still does.

A driver SIGKILLed, or ended by Ray when its GCS died, ends nothing: its MLflow runs would stay RUNNING. Every
sweep records its driver on its parent run (these tags: host, pid, the process's start time) and refreshes a
heartbeat there (tracking.Heartbeat); the next raysweep command on the store ends the runs of a dead driver
FAILED (tracking.reconcile_orphans): on this host at once when the process is gone, elsewhere when the
heartbeat is older than STALE_AFTER_S (the way W&B calls a run "crashed" when its heartbeats stop).
"""

from __future__ import annotations

import os
import time

HEARTBEAT_EVERY_S = 30.0
STALE_AFTER_S = 300.0
DRIVER_LOST = "driver lost"


def driver_tags() -> dict[str, str]:
    import socket

    import psutil

    return {"raysweep.driver.host": socket.gethostname(), "raysweep.driver.pid": str(os.getpid()),
            "raysweep.driver.started": repr(psutil.Process().create_time()),
            "raysweep.heartbeat": repr(time.time())}


def driver_alive(tags: dict, now: float | None = None) -> bool | None:
    """Whether the driver named in a parent run's tags still runs; None: the run names none (an older sweep)."""
    import socket

    import psutil

    host = tags.get("raysweep.driver.host")
    if host is None:
        return None
    if host == socket.gethostname():
        try:
            process = psutil.Process(int(tags["raysweep.driver.pid"]))
            return abs(process.create_time() - float(tags["raysweep.driver.started"])) < 1.0  # not a reused pid
        except (psutil.NoSuchProcess, KeyError, ValueError):
            return False
    return (now or time.time()) - float(tags.get("raysweep.heartbeat", 0)) < STALE_AFTER_S
