"""The answer on the console: the sweep's last block (print_answer), the evidence beside it (the noise scale's
time-to-target table and how it held against the sweep), and `confirm`'s start and finding."""

from __future__ import annotations

from raysweep.answer.records import UNPLACED
from raysweep.noise import in_samples
from raysweep.report.table import SAMPLES, fmt, format_table


def print_recommendation(rec) -> None:
    """The time-to-target table (`rec`: noise.Recommendation): relative samples, steps and time per global batch.
    Evidence for the answer (print_answer) and for `raysweep answer --batch N`, not an answer of its own: each row
    assumes its batch's LR is tuned, which the sweep's trials may not have done."""
    rows = [[str(c.global_batch), f"{c.samples_per_s:,.0f}", f"{c.samples:.2f}", f"{c.steps:.2f}", f"{c.time:.2f}"]
            for c in rec.candidates]
    print(f"\nthe gradient noise scale B_noise ≈ {in_samples(rec.noise_scale)} samples ({rec.source}), and what it "
          f"predicts")
    print("for the cost to reach the same loss at each global batch measured, with its LR tuned (McCandlish et al. "
          "2018): samples ∝ 1 + B/B_noise, steps ∝ 1 + B_noise/B, time ∝ samples ÷ samples/s (1 = the least)")
    print(format_table(("global_batch", "samples/s", "samples×", "steps×", "time×"), rows))
    print(f"batch growth stops paying near B ≈ B_noise ≈ {in_samples(rec.noise_scale)}: below it a doubled batch "
          f"nearly halves the steps; above it, steps fall little while samples grow. This is evidence, not the answer: "
          f"the answer is the sweep's best trial (below); `raysweep answer SPEC --batch N` predicts a recipe for any "
          f"batch and `raysweep confirm SPEC --batch N` measures it.")


def print_held(held, target: str) -> None:
    """The recommendation against the sweep (`held`: noise.Held per global batch): measured and predicted time to
    the target, and the error."""
    rows = [[str(h.global_batch), h.trial_id, f"{h.measured_s:.1f}", f"{h.predicted_s:.1f}", f"{h.error:+.0%}",
             f"{h.measured_samples:,.0f}", f"{h.predicted_samples:,.0f}"] for h in held]
    print(f"held against this sweep: each global batch's fastest trial to {target}, beside the prediction "
          f"(E_min fitted to all of them: the errors are the model's shape across batches)")
    print(format_table(("global_batch", "trial", "measured_s", "predicted_s", "error", "samples", "predicted"), rows))


def print_answer(answer, written: str | None = None) -> None:
    """The sweep's one answer (`answer`: answer.Answer; None: no trial ranked), its last block: the recipe whole,
    what it expects, the trials behind it, the LR for other batches, how to confirm it. `written`: where answer.json
    is."""
    if answer is None:
        print("\nanswer: none: no trial finished or was pruned (see the failures above)")
        return
    r, e, fit = answer.recipe, answer.expected, answer.lr_fit
    kind = ("predicted, not yet run" if answer.predicted and answer.trial_id is None else
            "predicted: its trial did not run the whole budget" if answer.predicted else "ran" if answer.trial_id
            else "the fitted recipe, confirmed better than the best trial's")
    print(f"\nanswer ({kind}): global batch {r.global_batch} = per-GPU {r.per_gpu_batch_size} × {r.num_workers} "
          f"workers × {r.grad_accum_steps} accumulation, peak LR {r.peak_lr:.2e}, warmup {r.warmup_epochs:g} "
          f"epoch{'s' if r.warmup_epochs != 1 else ''}, weight decay {r.weight_decay:.2e}")
    print(f"  recipe:   base_lr {r.base_lr:.3e} at reference batch {r.reference_batch_size} ({r.lr_rule} rule → "
          f"peak {r.peak_lr:.2e}); {r.schedule}; AdamW, {r.precision}, clip {r.grad_clip}")
    print(f"  model:    {r.model_line} (the recipe is this network's: another network needs its own sweep)")
    expects = [f"{e.metric} {fmt(e.value)}" if e.value is not None else ""]
    if e.time_to_target_s is not None:
        expects.append(f"the target in {e.time_to_target_s:.1f} training seconds")
    if e.samples is not None:
        expects.append(f"after {e.samples:,.0f} training samples" + (f" (≈ {e.seconds:.1f} s)" if e.seconds else ""))
    print(f"  expects:  {', '.join(x for x in expects if x)} at {e.at} ({e.source})")
    if answer.trial_id is not None:
        same = [t for t in answer.trials if t["role"] == "same global batch"]
        others = [t for t in answer.trials if t["role"] == "best of its global batch"]
        line = f"trial {answer.trial_id}, the sweep's best"
        if same:
            line += f"; {len(same)} more at batch {r.global_batch} (peak LR " + ", ".join(
                f"{t['peak_lr']:.1e}" for t in same[:4]) + ")"
        if others:
            line += "; the best at other batches: " + ", ".join(
                f"{t['global_batch']} ({e.metric} {fmt(t[e.metric])}, {t['status']} at epoch {t['epoch']})"
                for t in others[:4])
        print(f"  ran as:   {line}")
    if fit.fitted:
        low, high = fit.interval
        print(f"  LR × B:   best peak LR ∝ B^{fit.exponent:.2f} (90 % interval {low:.2f} to {high:.2f}: "
              f"{_supports(fit)}), fitted over {fit.trials} trials at global batches "
              f"{', '.join(map(str, fit.batches))} ({fit.budget}); B_noise ≈ {fmt(fit.b_noise, SAMPLES)}")
    else:
        print(f"  LR × B:   not fitted ({fit.reason})")
    print(f"  other B:  {used_words(fit)}")
    for note in answer.notes:
        print(f"  note:     {note}")
    if answer.confirmed is not None:
        print(f"  confirmed: {confirmation_line(answer.confirmed)}")
    print(f"  confirm:  {answer.confirm_command}   (two seeds, the whole budget, outside ASHA)")
    if written:
        print(f"  written:  {written}")


def print_confirming(answer, seeds: tuple[int, ...]) -> None:
    """What `confirm` is about to run: the recipe, its seeds, the whole budget."""
    r = answer.recipe
    what = ("the sweep's answer" if answer.trial_id else
            f"the fitted recipe at the answer's global batch {r.global_batch}"
            if answer.confirm_command.endswith("--fitted") else
            f"the predicted recipe at global batch {r.global_batch}")
    print(f"confirm: {what}: global batch {r.global_batch} (per-GPU {r.per_gpu_batch_size} × {r.num_workers} × "
          f"{r.grad_accum_steps}), peak LR {r.peak_lr:.2e}, warmup {r.warmup_epochs:g}, weight decay "
          f"{r.weight_decay:.2e}; seeds {', '.join(map(str, seeds))}, each for its whole budget, outside ASHA",
          flush=True)


def print_confirmation(c, answer, written: str) -> None:
    """`confirm`'s finding (`c`: metrics.ConfirmationRecord; None: it left no run): each seed's measurement beside
    what the recipe was expected to reach, and where it was written."""
    if c is None or not c.runs:
        print("\nconfirmed: no run of the confirmation reached the store (see the failures above)")
        return
    e = answer.expected
    print(f"\nconfirmation of global batch {c.global_batch}, peak LR {c.peak_lr:.2e} (MLflow run {c.parent_run_id}):")
    rows = []
    for run in c.runs:
        rows.append([str(run["seed"]), run["trial_id"], run["status"], str(run["epoch"]), fmt(run.get("value")),
                     fmt(run.get("time_to_target_s"), ".1f"), fmt(run.get("seconds_to_value"), ".1f")])
    rows.append(["predicted", answer.trial_id or "-", "", "", fmt(e.value), fmt(e.time_to_target_s, ".1f"),
                 fmt(e.seconds, ".1f")])
    print(format_table(("seed", "trial", "status", "epoch", e.metric, "to target s", f"to {e.metric} s"), rows))
    print(f"  {confirmation_line(c)}")
    print(f"  predicted: {e.source}")
    print(f"  written:  {written} (confirmed or confirmations), the sweep's MLflow parent run (answer.*) and its "
          f"report")


def _supports(fit) -> str:
    if fit.supports in ("linear", "sqrt", "none"):
        return f"supports the {fit.supports} rule"
    if fit.supports == "inconclusive":
        names = list(fit.consistent)
        return f"the sweep cannot tell the {', '.join(names[:-1])} and {names[-1]} rules apart"
    return "supports neither the linear nor the square-root rule"


def used_words(fit) -> str:
    """How a predicted batch gets its LR (answer.fit's check), in words."""
    check = fit.check
    if check is None:
        why = UNPLACED if len(fit.batches) > 1 else "one global batch ran"
        return f"a predicted batch scales the answer's LR by the square-root rule (unchecked: {why})"
    errors = ", ".join(f"{k} {v:.2f}" for k, v in check.errors.items())
    what = {"fit": f"the fit's B^{check.exponent:.2f}", "sqrt": "the square-root rule",
            "none": "keeping the answer's LR"}[check.used]
    unchecked = (f"; the fit's own B^{fit.exponent:.2f} not checked: without batch "
                 f"{' or '.join(map(str, check.unfitted))} the others' fit has no minimum" if check.unfitted else "")
    return (f"a predicted batch scales the answer's LR by {what}: the best at predicting each of batches "
            f"{', '.join(map(str, check.batches))} from the others (mean |ln error| {errors}{unchecked})")


def confirmation_line(c) -> str:
    """A confirmation (metrics.ConfirmationRecord) in a line: each seed's measured value beside the predicted one."""
    from types import SimpleNamespace

    p = SimpleNamespace(**{"value": None, "time_to_target_s": None, "seconds": None, **c.predicted})
    runs = ", ".join(f"seed {run['seed']}: {fmt(run.get('value'))}" + (
        f" ({run['time_to_target_s']:.1f} s to the target)" if run.get("time_to_target_s") is not None else "")
        for run in c.runs)
    mean, line = c.measured("value"), f"{runs}"
    if mean is not None and p.value:
        line += f"; mean {mean:.4g} against {p.value:.4g} expected ({mean / p.value - 1:+.1%})"
    time = c.measured("time_to_target_s")
    if time is not None and p.time_to_target_s:
        line += (f"; time to the target {time:.1f} s against {p.time_to_target_s:.1f} s "
                 f"({time / p.time_to_target_s - 1:+.1%})")
    seconds = c.measured("seconds_to_value")
    if p.seconds and seconds is not None:
        line += f"; to the answer's value in {seconds:.1f} s against {p.seconds:.1f} s predicted"
    return line


def print_verdict(line: str) -> None:
    """`confirm`'s verdict, or what it runs next (confirm.verdict, confirm.run_with_fitted)."""
    print(f"confirm: {line}", flush=True)
