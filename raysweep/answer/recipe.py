"""The answer itself: the sweep's best trial's recipe, what it reached and at which budget, the trials behind it,
and D, the samples a recipe trains over its whole budget (one definition, for τ and for every prediction)."""

from __future__ import annotations

import dataclasses
import json
import math

from raysweep.answer.confirmations import close, shortfall, with_confirmations
from raysweep.answer.fit import ceiling_at, fit_lr, judged_in_warmup, ran_whole
from raysweep.answer.records import FROM_BOTTOM, FROM_FIT, Answer, Expected, Recipe
from raysweep.metrics import FINISHED, MODEL_FACTORY, MODEL_KWARGS, MODEL_PARAMETERS, RunRecord, SweepRecord
from raysweep.metrics import names as M


def spec_of(record: SweepRecord):
    """The sweep's spec (config.SweepConfig) from the text it logged; None when it cannot be read (a store from
    before a schema change)."""
    import yaml
    from pydantic import ValidationError

    from raysweep.config import SweepConfig

    try:
        return SweepConfig.model_validate(yaml.safe_load(record.spec_text or "") or {})
    except (yaml.YAMLError, ValidationError, TypeError):
        return None


def ranked(record: SweepRecord) -> list[RunRecord]:
    """The sweep's own ranking, the summary table's (report/table.ranked: metrics.rank over the trials that did not
    fail, best first), so that the answer is the table's first row."""
    from raysweep.report.table import ranked as table_ranked

    return table_ranked(record)


def answer_of(record: SweepRecord, spec_file: str | None, advice) -> Answer | None:
    """The sweep's answer: its best trial's recipe; None when no trial ranked or the spec cannot be read.
    `spec_file`: the spec's path (and --set overrides), for the confirm command; `advice`: report.recommendation's
    noise.Recommendation (B_noise), or None.

    It `ran` when that trial ran its whole budget (train.epochs, or what filled train.time_budget_s) or reached the
    target; a trial pruned by ASHA, or stopped at tune.asha.max_t below train.epochs, did not: its value is at the
    budget it reached (`expected.at`) and the recipe is `predicted` until `confirm` measures it."""
    spec = spec_of(record)
    order = ranked(record)
    if spec is None or not order:
        return None
    best = order[0]
    recipe = recipe_of(best, spec)
    reached = record.target is not None and best.last(M.time_to_target_s) is not None
    whole = ran_whole(best, spec)
    ran = whole or reached
    seconds = best.last(M.train_seconds)
    words = f"epoch {best.epoch} of {recipe.resolved_epochs or spec.train.epochs}" + (
        f", {seconds:.1f} training seconds" if seconds else "")
    at = "the whole budget" if whole else "the target" if reached else (
        f"{words}: {'pruned by ASHA' if best.status != FINISHED else 'stopped at tune.asha.max_t'}, not the whole "
        f"budget")
    expected = Expected(record.metric, best.last(record.metric), best.last(M.time_to_target_s),
                        source=f"trial {best.trial_id}, {words}", at=at, train_seconds=seconds)
    notes = []
    if not ran:
        notes.append(f"trial {best.trial_id} did not run its whole budget ({at}): its value at the whole budget is "
                     f"a prediction until `confirm` measures it")
    fit = fit_lr(record, spec, advice.noise_scale if advice else None, order)
    samples = samples_run(record, spec, recipe.global_batch)
    tau = (recipe.global_batch / (recipe.peak_lr * recipe.weight_decay * samples)
           if samples and recipe.peak_lr and recipe.weight_decay else None)
    if fit.edge:
        notes.append(fit.edge)
    early = judged_in_warmup(record, spec)
    if early:
        notes.append(early)
    better = fitted_recipe(recipe, fit, tau, samples)
    answer = Answer(recipe, expected, ran, not ran, best.trial_id, _support(record, order, best, spec), fit, tau,
                    confirm_command(spec_file, None), samples=samples, better=better)
    return kept(record, with_confirmations(record, answer, notes))


BETTER = math.sqrt(2)  # the fitted best LR must lie further than this from the answer's to predict better


def better_lr(r: Recipe, fit) -> tuple[float, str] | None:
    """The best peak LR the sweep places at the answer's batch, and what placed it: the checked fit's bottom at the end
    of training where the fit beat both rules in the check (inside the LRs it saw), else the check's own measure
    there, the bottom of the sweep's bowl with a bottom per batch (inside the LRs the batch ran): moving no LR to
    another batch, it needs no slope. Kept below the cliff; None where neither places one."""
    if fit.fitted and fit.check and fit.check.used == "fit":
        lr, (low, high), source = fit.optimum(r.global_batch), fit.lr_range, FROM_FIT
        if not low <= lr <= high:
            return None
    elif r.global_batch in dict(fit.bottoms):
        lr, source = dict(fit.bottoms)[r.global_batch], FROM_BOTTOM
    else:
        return None
    ceiling = ceiling_at(fit, r.global_batch, fit.used_exponent)
    return (min(lr, ceiling) if ceiling else lr), source


def fitted_recipe(r: Recipe, fit, tau: float | None, samples: float | None) -> Recipe | None:
    """The answer's batch with the sweep's best LR there (`better_lr`), its weight decay through the answer's τ and D,
    where that LR lies further than BETTER from the answer's (the best the sweep sampled); else None. An answer
    never better than its best trial would leave this evidence unused."""
    from raysweep.optim import LR_RULE_POWER

    placed = better_lr(r, fit)
    if placed is None or abs(math.log(placed[0] / r.peak_lr)) <= math.log(BETTER):
        return None
    lr = placed[0]
    wd = r.global_batch / (lr * tau * samples) if tau and samples else r.weight_decay
    return dataclasses.replace(r, peak_lr=lr, base_lr=lr / (r.global_batch / r.reference_batch_size)
                               ** LR_RULE_POWER[r.lr_rule], weight_decay=wd)


def kept(record: SweepRecord, answer: Answer) -> Answer:
    """The answer, or the fitted recipe where both ran complete confirmations and the fitted one measured better
    (`tune --confirm` runs both on the same seeds); without both, a note says how to measure it."""
    b = answer.better
    if b is None:
        return answer
    mine = [c for c in record.confirmations if c.complete and c.global_batch == b.global_batch
            and close(c.peak_lr, b.peak_lr, 1e-6)]
    ours = answer.confirmed
    words = (f"{answer.better_source} puts the best peak LR at global batch {b.global_batch} at {b.peak_lr:.2e}, "
             f"{b.peak_lr / answer.recipe.peak_lr:.2f}× the answer's (the best the sweep sampled there)")
    if not mine or ours is None:
        return dataclasses.replace(answer, notes=(*answer.notes, (
            f"{words}: a better recipe is predicted (peak LR {b.peak_lr:.2e}, weight decay {b.weight_decay:.2e}); "
            f"measure it beside this one on the same seeds: `{answer.confirm_command} --fitted`, or `tune --confirm`")))
    theirs = mine[-1]
    a, f = ours.measured("value"), theirs.measured("value")
    short = shortfall(f, a, record.mode)
    if short is None:
        return answer
    gain = -short
    said = (f"{words}: on seeds {', '.join(str(r.get('seed')) for r in theirs.finished)} it measured "
            f"{record.metric} {f:.4g} against the best trial's recipe's {a:.4g}")
    if gain <= 0:
        return dataclasses.replace(answer, better=None, notes=(
            *answer.notes, f"{said} ({-gain:.1%} worse): the best trial's recipe is kept"))
    expected = dataclasses.replace(answer.expected, value=f, time_to_target_s=theirs.measured("time_to_target_s"),
                                   source=f"the fitted recipe's confirmation {theirs.parent_run_id}",
                                   at="the whole budget", train_seconds=None)
    return dataclasses.replace(answer, recipe=b, expected=expected, ran=True, predicted=False, trial_id=None,
                               confirmed=theirs, better=None, confirm_command=f"{answer.confirm_command} --fitted",
                               notes=(*answer.notes, f"{said} ({gain:.1%} better): the fitted recipe is the answer"))


def fitted_answer(base: Answer) -> Answer:
    """`--fitted`: the fitted recipe at the answer's batch as a recipe to confirm (a UserError where there is none)."""
    from raysweep.errors import UserError

    if base.better is None:
        if base.trial_id is None and base.ran:  # already the fitted recipe, measured better
            return base
        why = ("its best LR there lies within √2 of the answer's" if better_lr(base.recipe, base.lr_fit) else
               "neither the checked fit nor the bowl with a bottom per batch places a best LR there inside the LRs "
               "the sweep ran" + ("" if base.lr_fit.fitted else f" ({base.lr_fit.reason})"))
        raise UserError(f"--fitted: the sweep predicts no better recipe at global batch {base.recipe.global_batch} "
                        f"than its best trial's ({why}); confirm the answer itself")
    e = base.expected
    expected = dataclasses.replace(e, source=f"{e.source}: the best trial's, which the fitted recipe is predicted to "
                                             f"beat")
    return dataclasses.replace(base, recipe=base.better, expected=expected, ran=False, predicted=True, trial_id=None,
                               better=None, confirmed=None, confirm_command=f"{base.confirm_command} --fitted",
                               notes=(f"the fitted recipe at the answer's batch, from {base.better_source}: to beat "
                                      f"{base.expected.metric} {base.expected.value:.4g}, the best trial's",))


def recipe_of(t: RunRecord, spec) -> Recipe:
    """A trial's recipe: its knobs and derived values as logged, the spec's schedule."""
    train, data = spec.train, spec.data
    per_gpu, workers = int(t.number(M.per_gpu_batch_size)), int(t.number(M.world_size) or spec.scaling.num_workers)
    accum = int(t.number(M.grad_accum_steps) or 1)
    resolved = t.number(M.resolved_epochs)
    seed = t.number(M.seed)
    return Recipe(int(t.number(M.global_batch_size) or per_gpu * workers * accum), per_gpu, workers, accum,
                  t.number(M.peak_lr), t.number(M.base_lr), t.params.get(M.lr_rule, train.lr_rule),
                  int(t.number(M.reference_batch_size) or train.reference_batch_size), t.number(M.warmup_epochs),
                  t.number(M.weight_decay), train.min_lr, train.epochs, train.time_budget_s,
                  t.params.get(M.precision_used, train.precision), train.grad_clip, model_of(t, spec),
                  int(resolved) if resolved else None if train.time_budget_s else train.epochs,
                  int(t.number(M.train_size) or 0) or None,
                  {"height": data.height, "width": data.width, "channels": data.channels, "length": data.length,
                   "num_classes": len(data.charset)}, int(seed) if seed is not None else train.seed)


def model_of(t: RunRecord, spec) -> dict:
    """The network a trial trained, as its run logged it (metrics.MODEL_FACTORY, ...; a store from before the
    model plug-in: the spec's, the built-in CNN)."""
    kwargs = t.params.get(MODEL_KWARGS)
    count = t.params.get(MODEL_PARAMETERS)
    return {"factory": t.params.get(MODEL_FACTORY, spec.model.name),
            "kwargs": json.loads(kwargs) if kwargs else spec.model.factory_kwargs(),
            "parameters": int(count) if count else None}


def _support(record: SweepRecord, order: list[RunRecord], best: RunRecord, spec) -> list[dict]:
    """The trials behind the answer: it, the others of its global batch (how its LR and decay fared), and the best
    of every other batch (what the other batches reached)."""
    def row(t: RunRecord, role: str) -> dict:
        return {"trial_id": t.trial_id, "role": role, "status": t.status,
                "global_batch": int(t.number(M.global_batch_size) or 0), "peak_lr": t.number(M.peak_lr),
                "weight_decay": t.number(M.weight_decay), "warmup_epochs": t.number(M.warmup_epochs),
                "epoch": t.epoch, record.metric: t.last(record.metric),
                "time_to_target_s": t.last(M.time_to_target_s),
                "whole_budget": ran_whole(t, spec)}

    batch = best.number(M.global_batch_size)
    rows = [row(best, "the answer")]
    rows += [row(t, "same global batch") for t in order[1:] if t.number(M.global_batch_size) == batch]
    seen = {batch}
    for t in order:
        other = t.number(M.global_batch_size)
        if other not in seen:
            seen.add(other)
            rows.append(row(t, "best of its global batch"))
    return rows


def confirm_command(spec_file: str | None, batch: int | None) -> str:
    spec = spec_file or "SPEC"
    return f"python -m raysweep confirm {spec}" + (f" --batch {batch}" if batch else "")


# ---------------------------------------------------------------------------------------------
# One clock, one D


def rates(record: SweepRecord) -> dict[int, float]:
    """Samples per second at each global batch the sweep ran, on the budget's clock (train_seconds: evaluation
    included, as the budget, ASHA and the time to the target count it; metrics' samples_per_s counts training
    alone): the median over its trials of samples_seen / train_seconds at their last report."""
    import statistics

    out: dict[int, list[float]] = {}
    for t in record.trials:
        batch, samples, seconds = t.number(M.global_batch_size), t.last(M.samples_seen), t.last(M.train_seconds)
        if batch and samples and seconds and seconds > 0:
            out.setdefault(int(batch), []).append(samples / seconds)
    return {b: statistics.median(v) for b, v in out.items()}


def throughput_at(batch: int, measured: dict[int, float]) -> float | None:
    """Samples/s at a global batch: measured, else interpolated (log-log) between the measured batches around it,
    else the nearest measured one's (flat past the ends); None with no measurement."""
    if not measured:
        return None
    if batch in measured:
        return measured[batch]
    below = [b for b in measured if b < batch]
    above = [b for b in measured if b > batch]
    if below and above:
        b0, b1 = max(below), min(above)
        f = math.log(batch / b0) / math.log(b1 / b0)
        return math.exp(math.log(measured[b0]) + f * (math.log(measured[b1]) - math.log(measured[b0])))
    return measured[max(below)] if below else measured[min(above)]


def samples_run(record: SweepRecord, spec, batch: int) -> float | None:
    """D: the training samples a recipe at `batch` trains over its whole budget: train.epochs of whole steps, or
    under train.time_budget_s the budget at the batch's throughput on the budget's clock (`rates`). τ's D and every
    prediction's."""
    if spec is None:
        return None
    if spec.train.time_budget_s:
        rate = throughput_at(batch, rates(record))
        return rate * spec.train.time_budget_s if rate else None
    train_size = next((t.number(M.train_size) for t in record.trials if t.number(M.train_size)), None)
    return spec.train.epochs * (int(train_size) // batch) * batch if train_size else None
