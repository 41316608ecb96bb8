"""CPU seconds per test, for deciding what the suite's time buys (CONTRIBUTING.md, "Tests").

`RAYSWEEP_CPU_ACCOUNT=DIR python -m pytest ...` puts each pytest process (each xdist lane) in a cgroup of its own
(cgroup v1 cpuacct, as root): every process a test starts inherits it (its Ray daemons and workers, drivers, the
`ray up` hosts made in namespaces), so the cgroup's counter is what that lane's tests used, whatever the other lane
does to their wall time. Each test's line lands in DIR/<lane>.tsv: name, wall seconds, CPU seconds. Wall time under
two lanes says how the CPUs were shared; CPU seconds say what a test costs. `python tests/cpu_account.py DIR` sums
them. Off (nothing done) without the variable, or where the cgroup cannot be made (it says so once).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class Account:
    def __init__(self, out: Path, lane: str):
        for old in CPUACCT.glob("raysweep-*"):  # an earlier run's, once empty (a lane's last children outlive it)
            if not Path(f"/proc/{old.name.rsplit('-', 1)[-1]}").exists():  # never a live lane's
                try:
                    old.rmdir()
                except OSError:
                    pass
        self.group = CPUACCT / f"raysweep-{lane}-{os.getpid()}"
        self.group.mkdir(exist_ok=True)
        (self.group / "cgroup.procs").write_text(str(os.getpid()))
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / f"{lane}.tsv", "a", buffering=1)

    def usage_s(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def record(self, name: str, wall_s: float, cpu_s: float) -> None:
        self.file.write(f"{name}\t{wall_s:.1f}\t{cpu_s:.1f}\n")

    def close(self) -> None:
        """Back to the parent cgroup, and this one removed once nothing is left in it (the kernel refuses before)."""
        self.file.close()
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        try:
            self.group.rmdir()
        except OSError:
            pass


def start(config) -> Account | None:
    out = os.environ.get("RAYSWEEP_CPU_ACCOUNT")
    if not out or ":/raysweep-" in Path("/proc/self/cgroup").read_text():
        return None  # off, or a pytest a test started (the 3.10 one, a child check): its lane counts it already
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return None  # pytest-xdist's controller: a group of its own would hold its lanes, which then counted nothing
    lane = getattr(config, "workerinput", {}).get("workerid", "solo")
    try:
        return Account(Path(out), lane)
    except OSError as error:
        print(f"RAYSWEEP_CPU_ACCOUNT: no cgroup under {CPUACCT} ({error}); CPU seconds not recorded", file=sys.stderr)
        return None


def measured(account: Account | None, name: str):
    """Wraps one test's run (setup, call, teardown)."""
    if account is None:
        yield
        return
    wall, cpu = time.monotonic(), account.usage_s()
    yield
    account.record(name, time.monotonic() - wall, account.usage_s() - cpu)


def stop(account: Account | None) -> None:
    if account is not None:
        account.close()


def summary(folder: str, top: int = 40) -> None:
    rows = []
    for tsv in Path(folder).glob("*.tsv"):
        for line in tsv.read_text().splitlines():
            name, wall, cpu = line.split("\t")
            rows.append((float(cpu), float(wall), tsv.stem, name))
    by_file: dict[str, list[float]] = {}
    for cpu, wall, _, name in rows:
        at = by_file.setdefault(name.split("::")[0], [0.0, 0.0])
        at[0], at[1] = at[0] + cpu, at[1] + wall
    print(f"{len(rows)} tests: {sum(r[0] for r in rows):.0f} CPU s, {sum(r[1] for r in rows):.0f} wall s")
    print("by file (CPU s, wall s):")
    for name, (cpu, wall) in sorted(by_file.items(), key=lambda kv: -kv[1][0]):
        print(f"  {cpu:8.0f} {wall:8.0f}  {name}")
    print(f"the {top} costliest tests (CPU s, wall s, lane):")
    for cpu, wall, lane, name in sorted(rows, reverse=True)[:top]:
        print(f"  {cpu:8.0f} {wall:8.0f}  {lane:5} {name}")


if __name__ == "__main__":
    summary(sys.argv[1], *map(int, sys.argv[2:]))
