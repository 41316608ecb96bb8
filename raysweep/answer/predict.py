"""A batch the sweep did not run (`raysweep answer SPEC --batch N`, `confirm --batch N`): the answer's recipe moved
to global batch N, anchored at the answer so that the answer's own batch returns exactly the answer.

- **Peak LR**: lr(N) = lr_answer × (N / B_answer)^α, held flat past B_noise, with α the checked fit's exponent where
  the fit beat both rules on the batches the sweep ran, else the better rule's (answer.fit: the check), and kept a
  margin below any trial that diverged.
- **Weight decay** through AdamW's timescale τ = B / (η·λ·D) (the fraction of the run over which the weights are
  averaged; Wang & Aitchison 2024, arXiv 2405.13698; Bergsma et al. 2025, arXiv 2505.13738: at fixed data the best
  λ grows with B, τ stays): λ(N) = N / (η(N)·τ·D(N)), with τ the answer's and D one definition (recipe.samples_run):
  the samples the recipe trains over its whole budget.
- **The expected value**: the answer's (or the target) after E(N)/E(B_answer) of the samples the answer took,
  E(B) = E_min (1 + B / B_noise) (McCandlish et al. 2018, arXiv 1812.06162), at N's throughput on the budget's
  clock.
"""

from __future__ import annotations

import dataclasses

from raysweep.answer.confirmations import close, with_confirmations
from raysweep.answer.fit import ceiling_at, scaled
from raysweep.answer.recipe import answer_of, confirm_command, ranked, rates, samples_run, spec_of, throughput_at
from raysweep.answer.records import UNPLACED, Answer, Expected
from raysweep.metrics import SweepRecord
from raysweep.metrics import names as M
from raysweep.noise import in_samples
from raysweep.optim import LR_RULE_POWER

PREDICTORS = {"fit": "the sweep's checked fit", "sqrt": "the square-root rule", "none": "keeping the answer's LR"}


def predict(record: SweepRecord, batch: int, spec_file: str | None, advice) -> Answer:
    """The predicted recipe at global batch `batch` (the module's docstring): the answer's workers and accumulation,
    its per-GPU batch made up to `batch`. The answer's own batch is the answer. A batch the workers × accumulation
    cannot make is a UserError naming the nearest that can."""
    from raysweep.errors import UserError

    base = answer_of(record, spec_file, advice)
    if base is None:
        raise UserError(f"answer: the sweep {record.parent_name} has no trial to start from (none finished or was "
                        f"pruned); run `tune` first")
    spec, r = spec_of(record), base.recipe
    step = r.num_workers * r.grad_accum_steps
    made_of = f"per-GPU batch × {r.num_workers} workers × {r.grad_accum_steps} accumulation steps"
    if batch <= 0:
        raise UserError(f"--batch {batch}: expected a positive global batch ({made_of}), such as the answer's "
                        f"{r.global_batch}")
    if batch % step:
        below, above = max(step, batch // step * step), (batch // step + 1) * step
        raise UserError(f"--batch {batch}: a global batch is {made_of}, a multiple of {step}; the nearest are {below} "
                        f"and {above}")
    share = r.train_size // r.num_workers if r.train_size else None
    if share is not None and batch // r.num_workers > share:  # TrialConfig.check_data_fits's rule, for one batch
        raise UserError(f"--batch {batch}: more than the training set holds for one step ({r.train_size:,} images "
                        f"over {r.num_workers} workers: {share:,} each); the largest global batch this data runs is "
                        f"{share // r.grad_accum_steps * step:,}: ask for that or less, or train on more images")
    if batch == r.global_batch:
        return dataclasses.replace(base, confirm_command=confirm_command(spec_file, batch), notes=(
            *base.notes, f"global batch {batch} is the answer's own: this is the answer"))
    fit = base.lr_fit
    lr, notes = _lr_at(base, batch)
    base_lr = lr / (batch / r.reference_batch_size) ** LR_RULE_POWER[r.lr_rule]
    samples = samples_run(record, spec, batch)
    wd = r.weight_decay
    if base.tau and samples:
        wd = batch / (lr * base.tau * samples)
        notes.append(f"weight decay from the answer's AdamW timescale τ = B/(ηλD) = {base.tau:.3g}, D the "
                     f"{samples:,.0f} samples of the whole budget at this batch")
    per_epoch = (r.train_size // batch) * batch if r.train_size else None
    resolved = (min(r.epochs, max(1, round(samples / per_epoch))) if spec.train.time_budget_s and samples and per_epoch
                else r.epochs)
    recipe = dataclasses.replace(r, global_batch=batch, per_gpu_batch_size=batch // step, peak_lr=lr, base_lr=base_lr,
                                 weight_decay=wd, resolved_epochs=resolved, seed=None)
    expected = _expected_at(record, base, batch, advice)
    if expected.samples and samples and expected.samples > samples:
        what = "the target" if expected.time_to_target_s is not None else f"{expected.metric} {expected.value:.4g}"
        notes.append(f"its budget trains about {samples:,.0f} samples, fewer than the {expected.samples:,.0f} it needs "
                     f"for {what}: expect it to end short of that (raise train.epochs or train.time_budget_s)")
    ran = next((t for t in ranked(record) if t.number(M.global_batch_size) == batch
                and close(t.number(M.peak_lr), lr) and close(t.number(M.weight_decay), wd)), None)
    if ran is not None:
        notes.append(f"trial {ran.trial_id} ran close to this recipe (peak LR and weight decay within 10 %)")
    answer = Answer(recipe, expected, False, True, None, base.trials, fit, base.tau, confirm_command(spec_file, batch),
                    notes=tuple(notes), samples=samples)
    return with_confirmations(record, answer, [])


def _lr_at(base: Answer, batch: int) -> tuple[float, list[str]]:
    """The answer's peak LR moved to `batch` (the module's docstring), and the notes that say how."""
    r, fit = base.recipe, base.lr_fit
    exponent, check = fit.used_exponent, fit.check
    lr = scaled(r.peak_lr, r.global_batch, batch, exponent, fit.b_noise)
    if check is None:
        why = (f"unchecked: {UNPLACED}" + ("" if fit.fitted else f"; {fit.reason}") if len(fit.batches) > 1 else
               f"unchecked: the sweep ran one global batch ({fit.reason})" if fit.fitted else fit.reason)
        source = f"the square-root rule (B^{exponent:g}; {why})"
    else:
        errors = ", ".join(f"{k} {v:.2f}" for k, v in check.errors.items())
        source = (f"{PREDICTORS[check.used]} (B^{exponent:.2f}), the best of the check that left each of batches "
                  f"{', '.join(map(str, check.batches))} out (mean |ln error| {errors})")
        if check.used != "fit" and fit.fitted:
            source += f"; the fit's B^{fit.exponent:.2f} did not beat it, so it is not used"
    moved = f"({batch}/{r.global_batch})^{exponent:.2f}"
    if fit.b_noise and max(batch, r.global_batch) > fit.b_noise:  # fit.scaled holds each batch at B_noise
        moved = (f"({min(batch, fit.b_noise):.4g}/{min(r.global_batch, fit.b_noise):.4g})^{exponent:.2f}, each batch "
                 f"held at B_noise ≈ {in_samples(fit.b_noise)} at most")
    notes = [f"peak LR {lr:.2e} = the answer's {r.peak_lr:.2e} × {moved}, from {source}"]
    ceiling = ceiling_at(fit, batch, exponent)
    if ceiling is not None and lr > ceiling:
        notes.append(f"held at {ceiling:.2e}, a factor 2 below the LR a trial diverged at (moved to this batch); "
                     f"{lr:.2e} would be past the cliff")
        lr = ceiling
    if fit.batches and not min(fit.batches) / 2 <= batch <= 2 * max(fit.batches):
        notes.append(f"global batch {batch} is more than 2× outside the batches the sweep ran "
                     f"({min(fit.batches)} to {max(fit.batches)}): an extrapolation")
    if fit.b_noise and batch > fit.b_noise:
        notes.append(f"global batch {batch} is past B_noise ≈ {in_samples(fit.b_noise)}: the LR is held at "
                     f"B_noise's (Adam's best LR peaks near it), and each sample buys less")
    return lr, notes


def _expected_at(record: SweepRecord, base: Answer, batch: int, advice) -> Expected:
    """What a run at `batch` is expected to reach: the answer's value (or the target) after E(batch)/E(answer) of the
    samples the answer took to get there (McCandlish et al.: E(B) = E_min (1 + B / B_noise)), at the batch's
    throughput on the budget's clock (recipe.rates)."""
    e, r = base.expected, base.recipe
    answer_trial = next((t for t in record.trials if t.trial_id == base.trial_id), None)
    if answer_trial is None or advice is None:
        return Expected(e.metric, e.value, source="no B_noise or throughput measured: not predicted", at=e.at)
    rate = throughput_at(batch, rates(record))
    ratio = (1 + batch / advice.noise_scale) / (1 + r.global_batch / advice.noise_scale)
    if e.time_to_target_s is not None:
        samples = answer_trial.last(M.samples_to_target) * ratio
        seconds = samples / rate if rate else None
        return Expected(e.metric, e.value, seconds, samples, seconds,
                        f"the answer's {answer_trial.last(M.samples_to_target):,.0f} samples to the target × E(B) "
                        f"ratio {ratio:.2f} (B_noise ≈ {in_samples(advice.noise_scale)}), at {rate or 0:,.0f} "
                        f"samples/s",
                        at="the target")
    samples = answer_trial.last(M.samples_seen) * ratio
    seconds = samples / rate if rate else None
    return Expected(e.metric, e.value, None, samples, seconds,
                    f"the answer's {e.metric} {e.value:.4g} after its {answer_trial.last(M.samples_seen):,.0f} "
                    f"samples × E(B) ratio {ratio:.2f} (B_noise ≈ {in_samples(advice.noise_scale)}), at "
                    f"{rate or 0:,.0f} samples/s", at=e.at)
