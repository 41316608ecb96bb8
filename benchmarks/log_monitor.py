"""What Ray's log monitor costs an idle local cluster, at Ray's defaults and with raysweep's (cluster.LOG_MONITOR_ENV).

Each case is a fresh process that starts a local Ray cluster (2 CPUs, no dashboard), leaves the log files of
`--actors` short-lived actors in its session (each a process of its own, as a trial's ~8 are), then reads the log
monitor's own CPU time over `--seconds` of an idle cluster. The cases alternate, `--repeats` times each, so that
both see the same machine. Prints each case's share of one core and the ratio; last line:
RESULT log_monitor_cost ratio=<raysweep's ÷ Ray's defaults>.

    python benchmarks/log_monitor.py            # 150 actors (~280 log files), 60 s windows, 2 repeats
    python benchmarks/log_monitor.py --quick    # 4 actors, 3 s windows, 1 repeat: the code path, for CI

Figures in benchmarks/RESULTS.md (Ray's daemons).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RAY_DEFAULTS = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "1000", "LOG_NAME_UPDATE_INTERVAL_S": "0.5"}  # Ray 2.60's


def one_case(actors: int, seconds: float) -> dict:
    import psutil
    import ray

    from raysweep.cluster import ray_init_kwargs

    ray.init(num_cpus=2, include_dashboard=False, **ray_init_kwargs())  # its LOG_MONITOR_ENV only where unset

    @ray.remote(num_cpus=0.01)
    class Short:
        def pid(self) -> int:
            return os.getpid()

    for _ in range(actors):
        actor = Short.remote()
        ray.get(actor.pid.remote(), timeout=120)
        ray.kill(actor)
    session = ray._private.worker._global_node.get_session_dir_path()
    def named_log_monitor(p) -> bool:
        try:
            return any("log_monitor.py" in part for part in p.cmdline())
        except psutil.Error:  # a killed actor's worker not yet reaped (a zombie: no command line), or gone
            return False

    (monitor,) = [p for p in psutil.Process().children(recursive=True) if named_log_monitor(p)]
    time.sleep(2.0)  # the last actor's files found
    before, started = sum(monitor.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    share = (sum(monitor.cpu_times()[:2]) - before) / (time.monotonic() - started)
    files = len(os.listdir(os.path.join(session, "logs")))
    ray.shutdown()
    return {"share": share, "files": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--actors", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--case", choices=("ray", "raysweep"), help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    actors = args.actors or (4 if args.quick else 150)
    seconds = args.seconds or (3.0 if args.quick else 60.0)
    if args.case:
        print("CASE " + json.dumps(one_case(actors, seconds)))
        return
    from raysweep.cluster import LOG_MONITOR_ENV

    shares: dict[str, list[float]] = {"ray": [], "raysweep": []}
    files: dict[str, int] = {}
    for _ in range(args.repeats or (1 if args.quick else 2)):
        for case, env in (("ray", RAY_DEFAULTS), ("raysweep", LOG_MONITOR_ENV)):
            done = subprocess.run([sys.executable, __file__, "--case", case, "--actors", str(actors),
                                   "--seconds", str(seconds)], capture_output=True, text=True, timeout=900,
                                  env={**os.environ, **env})
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("CASE ")), None)
            if done.returncode != 0 or line is None:
                sys.exit(f"log_monitor: the {case} case failed: {done.stderr.strip()[-2000:]}")
            result = json.loads(line.removeprefix("CASE "))
            shares[case].append(result["share"])
            files[case] = result["files"]
    print(f"log monitor of an idle local cluster, {actors} actors' log files, {seconds:.0f} s windows")
    print(f"{'settings':<34} {'log files':>9} {'% of a core (median)':>21}")
    names = {"ray": "Ray's defaults", "raysweep": "raysweep's (LOG_MONITOR_ENV)"}
    for case in ("ray", "raysweep"):
        print(f"{names[case]:<34} {files[case]:>9} {100 * statistics.median(shares[case]):>21.2f}")
    ratio = statistics.median(shares["raysweep"]) / max(statistics.median(shares["ray"]), 1e-9)
    print(f"RESULT log_monitor_cost ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
