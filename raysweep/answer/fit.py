"""How the best peak LR grows with the global batch in this sweep: fitted from what the trials reached, checked by
leaving each batch out, bounded by the trials that diverged.

- **The law.** McCandlish et al. 2018 (arXiv 1812.06162, eq. 2.6): for SGD the best LR is ε_max / (1 + B_noise / B),
  linear in B well below B_noise and flat past it; for Adam it rises about as √B and peaks near B_noise, then falls
  (Malladi et al. 2022, arXiv 2205.10287; Li et al. 2024, arXiv 2405.14578). Predictions hold the LR at B_noise's
  past it.
- **The fit reads what each trial reached.** Every finished and pruned trial counts at every ASHA rung it reached
  (its value read where ASHA read it) and, where it ran its whole budget, at its own last report (the end: under
  train.time_budget_s that is wherever its budget ran out, below ASHA's max_t). A bowl in log LR whose bottom moves
  with log B, and with how far into its budget the value was read (the best LR early in training is not the best
  at the end: in the tests' world it is 2× higher at the start):
      v ≈ a_B + a_k + c1·y + c2·y² + c3·x·y + c4·y·(1 − p),   x = log B, y = log peak LR
  k the rung (or the end), p the share of the trial's whole budget behind the value (its epoch ÷ the epochs its
  budget runs; 1 at the end). One move c4 rather than a bottom per rung: a sweep that prunes hard has few trials past
  the first rung. A budget with fewer than MIN_LEVEL trials is left out. A target-stopped trial has no end value (it
  stopped at the target, not at a budget): its rungs count. A value read before the trial's warmup ended does not
  count: its LR had not reached the peak LR the fit places (answer_check's first rung, 2.2 s, is the end of the
  first epoch, its warmup: with them the fit put the best LR 1.5-2.6× below the grid's at batches 32 to 128).
  The best LR at batch B is the bowl's bottom at the end (p = 1): y*(x) = −(c1 + c3·x) / (2·c2), so it grows as
  B^α, α = −c3 / (2·c2): 1 is the linear rule, ½ the square-root rule. The interval is a bootstrap over the trials.
- **Diverged trials bound the LR from above** (`ceilings`): a prediction stays a factor CEILING_MARGIN below the
  lowest diverged LR, moved to its batch along the slope. An out-of-memory trial bounds the batch, not the LR: the
  probe's cap handles it.
- **The check** (`_checked`): each global batch left out in turn, its best peak LR (`_bottoms`: the bottom of the
  sweep's bowl at that batch, else the LR of its best trial where that trial ran its whole budget) predicted from
  the best-ranked other batch's by the fit (refitted without it), by the square-root rule and by keeping the LR.
  Every predictor moves the same measured best, not the answer's sampled LR: anchored there, the check chose
  whichever exponent made up for where that LR fell on the batches it left out (smaller than the answer's, mostly),
  and made it worse on the other side, where a user scales up. Predictions scale the answer's LR by the fit's
  exponent only where the fit's mean error beats both rules'; otherwise by the better rule.
  The rules can tie exactly, and a tie keeps the square-root rule: where the batches disagree (one's best LR falls
  with the batch, two others' rises faster than √B), the mean |ln error| is flat in the exponent between the two
  (tests/test_answer.py has the case benchmarks/answer_check.py met twice).
"""

from __future__ import annotations

import math

from raysweep.answer.records import RULES, FitCheck, LrFit
from raysweep.metrics import FAILED, FINISHED, PRUNED, RunRecord, SweepRecord
from raysweep.metrics import names as M

MIN_FIT_TRIALS = 8  # trials across two global batches at least, for the LR fit
MIN_LEVEL = 3  # trials a budget (a rung, or the end) needs to count in the fit
BOOTSTRAPS = 400  # resamples of the trials for the exponent's interval
INTERVAL = (0.05, 0.95)  # its quantiles: a 90 % interval
PRIOR_EXPONENT = RULES["sqrt"]  # AdamW's square-root rule (Malladi et al. 2022): where nothing checked beats it
CEILING_MARGIN = 2.0  # a prediction stays this factor below a diverged trial's LR (moved to its batch)
EDGE = 1.25  # a best LR within this factor of the largest (smallest) LR tried at its batch lies at the range's edge


def scaled(lr: float, from_batch: float, to_batch: float, exponent: float, b_noise: float | None) -> float:
    """`lr` moved from one global batch to another along B^exponent, held flat past B_noise."""
    cap = (lambda b: min(b, b_noise)) if b_noise else (lambda b: b)
    return lr * (cap(to_batch) / cap(from_batch)) ** exponent


def ran_whole(t: RunRecord, spec) -> bool:
    """Finished its whole budget: its epochs (train.epochs, or what its pace said fills train.time_budget_s), or under
    a time budget its seconds (an epoch slower than the pace estimate ends a trial at max_t one epoch early). Not
    pruned, not stopped at tune.asha.max_t below train.epochs, not stopped at the target."""
    if t.status != FINISHED:
        return False
    budget = spec.train.time_budget_s
    seconds = t.last(M.train_seconds)
    return t.epoch >= (t.number(M.resolved_epochs) or spec.train.epochs) or bool(
        budget and seconds is not None and seconds >= budget * (1 - 1e-6))


def _rows(record: SweepRecord, spec) -> tuple[list[tuple], int, str]:
    """(trial, batch, peak LR, level, value, progress) for every finished and pruned trial: level k < len(rungs) at
    rung k, len(rungs) at its end where it ran whole; progress the share of its whole budget's epochs behind the
    value (1 at the end). The trials counted; the budgets in words."""
    from raysweep.asha import AshaPlan
    from raysweep.report.importance import reading_at  # report/importance.py: metrics alone, never the report

    plan = AshaPlan.of(spec)
    rungs, end = sorted(plan.rungs), len(plan.rungs)
    sign = -1.0 if record.mode == "max" else 1.0
    rows, trials = [], 0
    for t in record.trials:
        batch, lr = t.number(M.global_batch_size), t.number(M.peak_lr)
        if t.status not in (FINISHED, PRUNED) or not (batch and lr):
            continue
        whole = t.number(M.resolved_epochs) or t.last(M.resolved_epochs) or spec.train.epochs
        mine = [(k, *reading_at(t, record.metric, plan.time_attr, b)) for k, b in enumerate(rungs)]
        if ran_whole(t, spec):
            mine.append((end, t.epoch, t.last(record.metric)))
        warmup = t.number(M.warmup_epochs) or 0.0
        mine = [(trials, batch, lr, k, sign * v, min(epoch / whole, 1.0)) for k, epoch, v in mine
                if v is not None and math.isfinite(v) and (epoch > warmup or k == end)]
        if mine:
            rows += mine
            trials += 1
    counts = {k: len({r[0] for r in rows if r[3] == k}) for k in range(end + 1)}
    kept = {k for k, n in counts.items() if n >= MIN_LEVEL}
    rows = [r for r in rows if r[3] in kept]
    unit = "epochs" if plan.time_attr == M.epoch else "training seconds"
    at = [f"{rungs[k]:g}" for k in sorted(kept) if k < end]
    words = [f"ASHA's rungs at {unit} {', '.join(at)}"] if at else []
    if end in kept:
        words.append("the end of each trial that ran its whole budget")
    return rows, len({r[0] for r in rows}), " and ".join(words) or "nowhere: too few trials at any budget"


def judged_in_warmup(record: SweepRecord, spec) -> str | None:
    """A note where ASHA's first rung read trials before their warmup ended: ASHA judged them before their LR reached
    its peak, and `_rows` leaves such values out. Under tune.asha.unit: seconds nothing can refuse that before the
    sweep (an epoch's seconds are the trials' to measure; in epochs the spec refuses it unless
    tune.asha.allow_grace_within_warmup). It names the grace period past the longest warmup that ran: a trial's
    time at the last epoch inside its warmup. None where no trial was read inside its warmup."""
    from raysweep.asha import AshaPlan
    from raysweep.report.importance import reading_at

    plan = AshaPlan.of(spec)
    if not plan.rungs:
        return None
    rung = min(plan.rungs)
    compared = inside = stopped = 0
    longest = 0.0
    for t in record.trials:
        if t.status not in (FINISHED, PRUNED):
            continue
        epoch, value = reading_at(t, record.metric, plan.time_attr, rung)
        if value is None:
            continue
        warmup = t.number(M.warmup_epochs) or 0.0
        compared += 1
        if epoch <= warmup:
            inside += 1
            stopped += t.status == PRUNED and t.epoch == epoch
        longest = max(longest, (t.history.get(plan.time_attr) or {}).get(math.floor(warmup), 0.0))
    if not inside:
        return None
    unit = "epochs" if plan.time_attr == M.epoch else "training seconds"
    return (f"ASHA's first rung ({rung:g} {unit}) read {inside} of the {compared} trials it compared inside their "
            f"warmup and stopped {stopped} of them there, before their LR reached its peak (the LR fit leaves such "
            f"values out): raise tune.asha.grace_period past {longest:.3g} {unit}, the longest warmup a trial took")


def _least_squares(data, center, tail: list):
    """Least squares of v on an intercept per batch and per level, y·(1 − progress) (the bottom's move over training:
    module docstring) and the `tail` columns, last; the coefficients, or None where the design is singular. Where
    the progress does not vary, without the move: one bottom for all."""
    import numpy as np

    y = np.log(data[:, 2]) - center[1]
    batches, levels = np.unique(data[:, 1]), np.unique(data[:, 3])
    base = [*(data[:, 1] == b for b in batches), *(data[:, 3] == k for k in levels[1:])]
    for extra in ([y * (1 - data[:, 5])], []):
        design = np.column_stack([*base, *extra, *tail]).astype(np.float64)
        if np.linalg.matrix_rank(design) == design.shape[1]:
            return np.linalg.lstsq(design, data[:, 4], rcond=None)[0]
    return None


def _bowl(data, center) -> tuple[float, float, float] | None:
    """`_least_squares` with y, y² and x·y: (c1, c2, c3) at the end of training (progress 1), or None where it is no
    bowl in y (c2 ≤ 0) or the design is singular."""
    import numpy as np

    x, y = np.log(data[:, 1]) - center[0], np.log(data[:, 2]) - center[1]
    coef = _least_squares(data, center, [y, y * y, x * y])
    if coef is None:
        return None
    c1, c2, c3 = (float(c) for c in coef[-3:])
    return (c1, c2, c3) if c2 > 0 else None


def _exponent(data, center) -> float | None:
    coef = _bowl(data, center) if len({float(b) for b in data[:, 1]}) >= 2 else None
    return -coef[2] / (2 * coef[1]) if coef else None


def fit_lr(record: SweepRecord, spec, b_noise: float | None, ranked: list[RunRecord], seed: int = 0) -> LrFit:
    """How the best peak LR grows with the global batch (the module's docstring); `ranked`: the sweep's trials best
    first (report.table.ranked), for the check. Needs MIN_FIT_TRIALS trials across two global batches."""
    import numpy as np

    b_noise = b_noise if b_noise and math.isfinite(b_noise) and b_noise > 0 else None
    rows, trials, words = _rows(record, spec)
    batches = tuple(sorted({int(r[1]) for r in rows}))
    data = np.array(rows, dtype=np.float64).reshape(-1, 6)
    center = (float(np.log(data[:, 1]).mean()), float(np.log(data[:, 2]).mean())) if rows else (0.0, 0.0)
    ceilings = tuple(sorted((int(t.number(M.global_batch_size)), t.number(M.peak_lr)) for t in record.trials
                            if t.status == FAILED and t.failure == "diverged" and t.number(M.global_batch_size)
                            and t.number(M.peak_lr)))

    def without(reason: str) -> LrFit:
        fit = LrFit(None, None, "undetermined", trials, batches, words, b_noise, reason, ceilings=ceilings)
        return _checked(fit, data, center, ranked, spec)

    if trials < MIN_FIT_TRIALS or len(batches) < 2:
        return without(f"{trials} finished and pruned trials with a value read after their warmup, over "
                       f"{len(batches)} global batch(es): the fit needs {MIN_FIT_TRIALS} across 2 batches or more")
    coef = _bowl(data, center)
    if coef is None:
        return without(f"no minimum in peak LR within the {trials} trials' LRs (the best LR of a batch lies at the "
                       f"edge of the searched range: widen search.base_lr)")
    rng = np.random.default_rng(seed)
    by_trial = [data[data[:, 0] == i] for i in np.unique(data[:, 0])]
    exponents = [e for e in (_exponent(np.concatenate([by_trial[i] for i in rng.integers(0, trials, trials)]),
                                       center) for _ in range(BOOTSTRAPS)) if e is not None]
    if len(exponents) < BOOTSTRAPS / 2:
        return without(f"a minimum in peak LR in only {len(exponents)} of {BOOTSTRAPS} resamples of the {trials} "
                       f"trials: too few or too noisy to place the best LR")
    alpha = -coef[2] / (2 * coef[1])
    low, high = (float(q) for q in np.quantile(exponents, INTERVAL))
    holds = tuple(name for name, value in RULES.items() if low <= value <= high)
    supports = "inconclusive" if len(holds) > 1 else holds[0] if holds else "neither"
    reason = (f"the bowl v ≈ a_B + a_k + c1·log η + c2·log² η + c3·log B·log η + c4·log η·(1 − p) fitted to {trials} "
              f"trials "
              f"({len(rows)} values: {words}; tune.metric{', negated' if record.mode == 'max' else ''}); the "
              f"interval from {len(exponents)} bootstrap resamples of the trials")
    fit = LrFit(float(alpha), (low, high), supports, trials, batches, words, b_noise, reason, holds, coef, center,
                (float(data[:, 2].min()), float(data[:, 2].max())), ceilings=ceilings)
    return _checked(fit, data, center, ranked, spec)


def _best_by_batch(ranked: list[RunRecord]) -> dict[int, RunRecord]:
    out: dict[int, RunRecord] = {}
    for t in ranked:
        batch = t.number(M.global_batch_size)
        if batch and t.number(M.peak_lr):
            out.setdefault(int(batch), t)
    return out


def _bottoms(data, center) -> dict[int, float]:
    """Each global batch's best peak LR at the end of training, read from the sweep's bowl with a bottom of its own
    per batch: the fit's design (an intercept per batch and per level, y², the bottom's move over training
    y·(1 − p)) with a y term per batch instead of c1 + c3·x, so the bowl's depth and its move are pooled over every
    trial but where each batch's bottom lies is its own trials' doing. Only bottoms inside the LRs the batch ran
    (after its warmup); none where the pooled bowl is none. The check's measurement: a batch's best trial is often
    pruned at an early rung (best early at a higher LR) and is a sampled LR, off its batch's best by the sampling."""
    import numpy as np

    if len(data) == 0:
        return {}
    y = np.log(data[:, 2]) - center[1]
    batches = np.unique(data[:, 1])
    coef = _least_squares(data, center, [*(y * (data[:, 1] == b) for b in batches), y * y])
    if coef is None or coef[-1] <= 0:
        return {}
    c2, out = float(coef[-1]), {}
    for b, c1 in zip(batches, coef[-1 - len(batches):-1]):
        bottom = -float(c1) / (2 * c2)  # in centred log LR
        ran = y[data[:, 1] == b]
        if ran.min() <= bottom <= ran.max():
            out[int(b)] = math.exp(center[1] + bottom)
    return out


def _checked(fit: LrFit, data, center, ranked: list[RunRecord], spec) -> LrFit:
    """The fit with its check (the module's docstring) and the searched range's edge, where there is one. A batch is
    measured by its bottom (`_bottoms`), else by its best trial's LR where that trial ran its whole budget; a batch
    with neither (its best trial pruned early, where the best LR is higher) is not measured. Every predictor moves
    the same LR, the anchor batch's measured best, so that the check compares exponents and not where the sweep's
    sampled LR at the anchor happened to fall (that LR is the answer's to move, not the check's)."""
    import dataclasses

    best = _best_by_batch(ranked)
    bottoms = _bottoms(data, center)
    measured = {b: bottoms[b] if b in bottoms else t.number(M.peak_lr) for b, t in best.items()
                if b in bottoms or ran_whole(t, spec)}
    errors: dict[str, list[float]] = {"fit": [], "sqrt": [], "none": []}
    unfitted: list[int] = []  # left out, the others' refit had no minimum
    for batch in measured:
        a_batch = next((b for b in measured if b != batch), None)  # the best-ranked other batch: the answer's first
        if a_batch is None:
            continue
        rest = data[data[:, 1] != batch]
        alpha = _exponent(rest, center) if fit.fitted and len(rest) else None
        if fit.fitted and alpha is None:
            unfitted.append(batch)
        guesses = {"sqrt": RULES["sqrt"], "none": RULES["none"], **({"fit": alpha} if alpha is not None else {})}
        for name, exponent in guesses.items():
            moved = scaled(measured[a_batch], a_batch, batch, exponent, fit.b_noise)
            errors[name].append(abs(math.log(moved / measured[batch])))
    left_out = tuple(sorted(measured)) if errors["sqrt"] else ()
    means = {k: sum(v) / len(v) for k, v in errors.items() if v and len(v) == len(errors["sqrt"])}
    check = None
    if means:
        used = chosen(means)
        check = FitCheck(means, left_out, used, fit.exponent if used == "fit" else RULES[used],
                         tuple(sorted(unfitted)))  # any of them keeps `fit` out of the means
    return dataclasses.replace(fit, check=check, edge=_edge(fit, ranked), bottoms=tuple(sorted(bottoms.items())))


TIE = 1e-9  # mean errors closer than this are a tie: the rules' exact tie (module docstring) differs in the last bit


def chosen(means: dict[str, float]) -> str:
    """The predictor the check picks from its mean errors: the fit only where it beats both rules, else the better
    rule, the square-root rule on a tie (computed in floating point, the exact tie came out 1e-17 either way)."""
    rule = "sqrt" if means["sqrt"] <= means["none"] + TIE else "none"
    return "fit" if "fit" in means and means["fit"] < means[rule] - TIE else rule


def _edge(fit: LrFit, ranked: list[RunRecord]) -> str | None:
    """One line where the answer's batch has its best LR at (or past) the edge of the LRs tried there: its best
    trial's LR within EDGE of the largest (smallest) tried, or the fit's bottom past it, with the range of
    search.base_lr to search next. A diverged trial above closes the upper edge (the cliff is found)."""
    if not ranked:
        return None
    top = ranked[0]
    batch = int(top.number(M.global_batch_size) or 0)
    tried = [t.number(M.peak_lr) for t in ranked if int(t.number(M.global_batch_size) or 0) == batch]
    if len(tried) < 3 or not top.number(M.peak_lr):
        return None
    lr, base = top.number(M.peak_lr), top.number(M.base_lr) or top.number(M.peak_lr)
    bottom = fit.optimum(batch) if fit.check and fit.check.used == "fit" else None
    factor = base / lr
    if (lr * EDGE >= max(tried) or (bottom and bottom > max(tried))) and not any(
            b == batch and c > lr for b, c in fit.ceilings):
        return (f"the best peak LR at global batch {batch} ({lr:.2e}) is at the top of the LRs tried there (up to "
                f"{max(tried):.2e}): search higher next, search.base_lr: {{loguniform: [{base / 2:.1e}, "
                f"{max(tried) * factor * 4:.1e}]}}")
    if lr / EDGE <= min(tried) or (bottom and bottom < min(tried)):
        return (f"the best peak LR at global batch {batch} ({lr:.2e}) is at the bottom of the LRs tried there (down "
                f"to {min(tried):.2e}): search lower next, search.base_lr: {{loguniform: "
                f"[{min(tried) * factor / 4:.1e}, {base * 2:.1e}]}}")
    return None


def ceiling_at(fit: LrFit, batch: float, exponent: float) -> float | None:
    """The highest peak LR a prediction at `batch` may take: CEILING_MARGIN below the lowest diverged LR, each moved
    to `batch` along B^exponent; None with no diverged trial."""
    bounds = [scaled(lr, b, batch, exponent, fit.b_noise) / CEILING_MARGIN for b, lr in fit.ceilings]
    return min(bounds) if bounds else None
