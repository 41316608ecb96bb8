"""The left-out batch's predicted LR where the ground truth is known exactly: tests/answer_world.py's made-up sweeps
(not the fit's own model: the best LR 2× higher early than at the end, an asymmetric bowl with a divergence cliff,
ASHA on noisy values) in worlds whose best LR grows as B^0, B^0.25, B^0.5, B^0.8 and B^1, many sweeps each.

    python benchmarks/fit_worlds.py              # 40 sweeps a world, about 20 s
    python benchmarks/fit_worlds.py --quick      # 5 sweeps, two worlds (CI)

Each sweep searches global batches 32, 64 and 128 (60 trials); its answer's peak LR is moved to 256, the batch it
left out, by `raysweep answer --batch 256`'s code (answer.predict). Counted over a world's sweeps, against the
world's best LR at 256, as benchmarks/answer_check.py holds a real grid's: within 1.25×; closer than both trivial
predictors (keeping the answer's LR, and the square-root rule from it); as near as the nearest of those two and the
fit's own exponent (used or not); how often the check used the fit; the fit's own exponent's LR within 1.25×;
and how often the fit's bottom at the answer's batch lies more than 1.1× below the world's best there (RESULT
fit_worlds_B025_within: the share within 1.25× in the B^0.25 world).
Where a rule is the world's truth (B^0, B^0.5) the prediction can at best tie it, and "closer than both" measures
chance; where neither is (B^0.25 between them, B^0.8 and B^1 past √B), it measures the fit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # raysweep, and the tests' made-up sweep (tests/answer_world.py)

EXPONENTS = (0.0, 0.25, 0.5, 0.8, 1.0)
SEARCHED = (16, 32, 64)  # per-GPU batches of the made-up spec's two workers: global 32, 64, 128
LEFT_OUT = 256


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 sweeps in two worlds (B^0.5, B^1)")
    parser.add_argument("--sweeps", type=int, default=None, help="made-up sweeps a world (default 40; 5 in --quick)")
    args = parser.parse_args()
    exponents = (0.5, 1.0) if args.quick else EXPONENTS
    sweeps = args.sweeps or (5 if args.quick else 40)
    print(f"fit_worlds: {sweeps} made-up sweeps a world over global batches {[2 * b for b in SEARCHED]}, the "
          f"prediction at {LEFT_OUT} against the world's best LR there", flush=True)
    print(f"{'world':>7}  {'within 1.25x':>12}  {'beats both rules':>16}  {'nearest':>7}  {'fit used':>8}  "
          f"{'fit own within':>14}  {'fit bottom low':>14}")
    from answer_world import left_out_clauses

    counted = {}
    for exponent in exponents:
        rows = [left_out_clauses(exponent, seed, SEARCHED, LEFT_OUT) for seed in range(sweeps)]
        counts = counted[exponent] = {k: sum(row[k] for row in rows) for k in rows[0]}
        print(f"{f'B^{exponent:g}':>7}  {counts['within']:>12}  {counts['beats_rules']:>16}  {counts['nearest']:>7}  "
              f"{counts['fit_used']:>8}  {counts['fit_own_within']:>14}  {counts['fit_bottom_low']:>14}", flush=True)
    for exponent, counts in counted.items():
        for clause, count in counts.items():  # B050: the B^0.5 world (the exponent in hundredths)
            print(f"RESULT fit_worlds_B{round(exponent * 100):03d}_{clause} value={count / sweeps:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
