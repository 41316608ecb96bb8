"""What rebuilding a sweep's report costs when an earlier report lies where it is written (what `confirm`,
`tune --resume` and `raysweep report` do after `tune` wrote one), against building it where none is.

The sweep is tests/answer_world.py's made-up one (60 trials by default: large_batch.yaml runs 24, and a
sweep that is resumed or widened grows), written into a SQLite MLflow store as `tune` writes one. Each repetition
publishes it into a new folder (every trial's PNG drawn) and then into the same folder again (each trial's PNG kept
where its trial did not change: report/plots.py, trial_key); the two alternate, and the figure is the median of the
repetitions' own ratios. Both include the sweep's own plots, report.html, answer.json and the MLflow logging.

    python benchmarks/report_rebuild.py            # 60 trials, 3 repetitions (~3 min on two cores)
    python benchmarks/report_rebuild.py --quick    # 12 trials, 1 repetition (CI)

Last line: RESULT report_rebuild ratio=<new folder ÷ over the earlier report>.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # raysweep, and the tests' made-up sweep (tests/answer_world.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trials", type=int)
    p.add_argument("--repeats", type=int)
    args = p.parse_args()
    trials = args.trials or (12 if args.quick else 60)
    repeats = args.repeats or (1 if args.quick else 3)

    from answer_world import world, write_world

    from raysweep import report
    from raysweep.tracking import load_sweep

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        write_world(world(n=trials), uri, f"{tmp}/artifacts")
        record = load_sweep(uri, "w")
        drawn = sum(1 for t in record.trials if t.history)
        print(f"report_rebuild: a made-up sweep of {trials} trials ({drawn} with curves), SQLite store; "
              f"{repeats} repetition(s)")
        print(f"{'repetition':>10}  {'new folder s':>12}  {'over it s':>9}  {'ratio':>6}")
        ratios = []
        for i in range(repeats):
            out = f"{tmp}/report-{i}"
            seconds = []
            for _ in range(2):  # a new folder, then the same folder again
                start = time.perf_counter()
                report.publish(load_sweep(uri, "w"), out, "w.yaml")
                seconds.append(time.perf_counter() - start)
            ratios.append(seconds[0] / seconds[1])
            print(f"{i + 1:>10}  {seconds[0]:>12.2f}  {seconds[1]:>9.2f}  {ratios[-1]:>6.2f}")
    print(f"RESULT report_rebuild ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
