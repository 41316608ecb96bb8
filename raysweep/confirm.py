"""`raysweep answer` and `raysweep confirm`: the sweep's answer (or the predicted recipe for another global batch)
printed from the store, and run for its whole budget outside ASHA on two seeds, its measurements beside the
prediction. What a confirmation measured goes to the sweep's answer.json, its parent run's `answer.*` metrics and
its report (report.publish rebuilds them from the store, which now holds the confirmation).

A confirmation runs the sweep's own spec as it logged it (data, model, scaling, the schedule, tune.target), with the
recipe's knobs fixed; the spec given on the command line names the sweep (its experiment, store and storage_path).
Its exit code is 1 when a seed did not finish (the confirmation is partial: only finished seeds count) and, with
`--fail-above PCT`, when the mean of the seeds misses the expected value by more than PCT percent; else 0 (a CI job
can gate on it).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from raysweep import layout, storage
from raysweep.errors import UserError


def _sweep_of(config):
    """The newest `tune` sweep of a spec's experiment (tracking.read_sweep), and the noise scale's advice on it."""
    from raysweep import report, tracking

    record = tracking.read_sweep(tracking.resolve_tracking_uri(config.mlflow.tracking_uri), config.experiment_name,
                                 config.mlflow.retry_s, command=config.source)  # a UserError without one
    return record, report.recommendation(record)


def answer_for(config, batch: int | None, fitted: bool = False):
    """(the sweep's record, its answer; or with `batch`, the predicted recipe at that global batch; or `fitted`, the
    fitted recipe at the answer's batch: answer.recipe.fitted_answer)."""
    from raysweep.answer import answer_of, predict
    from raysweep.answer.recipe import fitted_answer

    if fitted and batch is not None:
        raise UserError(f"--fitted with --batch {batch}: --fitted is the answer's own batch with the fit's LR; "
                        f"--batch N is another batch's prediction (it uses the fit's slope already): give one")
    record, advice = _sweep_of(config)
    if batch is not None:
        return record, predict(record, batch, config.command_args, advice)
    answer = answer_of(record, config.command_args, advice)
    if answer is None:
        raise UserError(f"{config.source}: the sweep {record.parent_name} has no answer: no trial finished or was "
                        f"pruned (see `raysweep report {config.command_args}`)")
    return record, fitted_answer(answer) if fitted else answer


def show(config, batch: int | None, fitted: bool = False) -> int:
    """`raysweep answer SPEC [--batch N | --fitted]`: the sweep's answer, the predicted recipe at global batch N, or
    the fitted recipe at the answer's batch."""
    from raysweep.answer import console as answer_console

    _, answer = answer_for(config, batch, fitted)
    answer_console.print_answer(answer)
    return 0


def confirm_spec(record, config, recipe):
    """The spec a confirmation runs: the sweep's as it logged it (else the one given) with the recipe's knobs fixed,
    under the given spec's name, storage and store; and the per-GPU batch cap the sweep had (a number), if any."""
    from raysweep.answer import spec_of
    from raysweep.config import SearchConfig

    logged = spec_of(record) or config
    cap = getattr(logged.search.per_gpu_batch_size, "max", None)
    spec = logged.model_copy(update={"name": config.name, "storage_path": config.storage_path,
                                     "mlflow": config.mlflow, "search": SearchConfig(**recipe.knobs())})
    spec._source, spec._args = config._source, config._args
    return spec, cap if isinstance(cap, int) else None


def run(config, batch: int | None = None, seeds: tuple[int, ...] | None = None, address: str | None = None,
        verbose: bool = False, progress_every_s: float = 30.0, cap_batch: int | None = None,
        fail_above: float | None = None, fitted: bool = False) -> int:
    """`raysweep confirm SPEC [--batch N] [--seeds a,b]`: the answer (or the prediction at N) on each seed (default:
    the two after train.seed: the sweep's trials all ran train.seed), for its whole budget, outside ASHA; then each
    seed's measurement beside the prediction, and the sweep's answer.json, MLflow and report updated. `cap_batch`:
    `tune --cap-batch`'s (else the sweep's search.per_gpu_batch_size.max, where a number); `fail_above`: the
    fraction the value may miss the expected by (the module's docstring: the exit code)."""
    from raysweep import report, sweep, tracking
    from raysweep.answer import console as answer_console
    from raysweep.answer.confirmations import close

    record, answer = answer_for(config, batch, fitted)
    seeds = tuple(seeds) if seeds else (config.train.seed + 1, config.train.seed + 2)
    spec, cap = confirm_spec(record, config, answer.recipe)
    r = answer.recipe
    answer_console.print_confirming(answer, seeds)
    confirming = sweep.Confirming(record.parent_run_id, seeds, json.dumps(asdict(answer.expected)), r.global_batch,
                                  r.peak_lr)
    code = sweep.run(spec, address=address, verbose=verbose, progress_every_s=progress_every_s,
                     cap_batch=cap_batch if cap_batch is not None else cap, confirming=confirming)
    uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    again = sweep.in_store(config, lambda: tracking.load_sweep(uri, config.experiment_name, record.parent_run_id),
                           "the sweep's read")  # with this confirmation
    mine = next((c for c in reversed(again.confirmations) if c.global_batch == r.global_batch
                 and close(c.peak_lr, r.peak_lr, 1e-6)), None)  # the fitted recipe shares the answer's batch
    if mine is not None:
        sweep.in_store(config, lambda: tracking.log_confirmation(uri, mine), "the confirmation's figures")
    report_dir = storage.join(storage.resolve(config.storage_path), config.name, layout.REPORT)
    built = sweep.in_store(config, lambda: report.publish(again, report_dir, config.command_args), "the report")
    answer_console.print_confirmation(mine, answer, storage.join(report_dir, report.ANSWER_FILE))
    if built.answer is not None and built.answer.confirmed is not None and batch is None:
        answer_console.print_answer(built.answer)
    return verdict(mine, answer.expected.value, record.mode, fail_above) if code == 0 else code


def run_with_fitted(config, **kwargs) -> int:
    """`tune --confirm`: the answer confirmed and, where the sweep predicts a better recipe at its batch
    (answer.recipe.fitted_recipe), that one on the same seeds; the answer then keeps whichever measured better.
    The exit code is the worse of the two."""
    code = run(config, **kwargs)
    _, answer = answer_for(config, None)
    if answer.better is None:
        return code
    from raysweep.answer import console as answer_console

    answer_console.print_verdict(f"{answer.better_source} predicts a better recipe at global batch "
                                 f"{answer.recipe.global_batch}: peak LR {answer.better.peak_lr:.2e}; it runs next, on "
                                 f"the same seeds")
    return max(code, run(config, fitted=True, **kwargs))


def verdict(mine, expected: float | None, mode: str, fail_above: float | None) -> int:
    """The exit code of a confirmation (`mine`: metrics.ConfirmationRecord, None: it left no run), with its line."""
    from raysweep.answer import console as answer_console
    from raysweep.answer.confirmations import miss

    if mine is None or not mine.complete:
        answer_console.print_verdict("partial: a seed did not finish, so the confirmation does not measure the "
                                     "recipe (exit 1)")
        return 1
    if fail_above is None:
        return 0
    short = miss(mine.measured("value"), expected, mode)
    if short is None or short > fail_above:
        what = "no value to compare" if short is None else f"misses the expected value by {short:.1%}"
        answer_console.print_verdict(f"failed: the seeds' mean {what}, more than --fail-above {fail_above:.0%} "
                                     f"allows (exit 1)")
        return 1
    answer_console.print_verdict(f"passed: the seeds' mean is within {fail_above:.0%} of the expected value")
    return 0
