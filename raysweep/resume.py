"""`tune --resume`: the checks before anything starts, the spec comparison, the take-over of the sweep's parent run,
and what is left to run.

Tune restores the experiment itself (`Tuner.restore`, in sweep.py); this module decides whether it may, and what the
driver must know before it does: the parent run to keep writing to, and the trials the store says ended for good
(relay.run_trial ends those as they ended).
"""

from __future__ import annotations

from dataclasses import dataclass

from raysweep import storage
from raysweep.errors import UserError

# keys a resumed sweep may change: how long to wait and how often to retry, nothing a trial computes
RESUME_MAY_CHANGE = ("scaling.worker_start_timeout_s", "scaling.max_setup_failures", "train.max_failures",
                     "train.max_infra_retries", "tune.keep_warm_s")
# the keys that found the sweep (its storage and store): compared by where they lead, not by their text
RESUME_IDENTITY = ("name", "storage_path", "mlflow.")


def check_resume(config, tracking_uri: str, experiment_path: str, name: str) -> str:
    """What `--resume` needs, checked before Ray starts or the data loads: a restorable Tune experiment at
    `experiment_path`, its MLflow parent run, a spec (config.SweepConfig) that agrees with the spec.yaml logged
    there, and no driver still running it. Returns the parent run id; a UserError (one line) names what is wrong."""
    import yaml
    from ray.tune import Tuner

    from raysweep import drivers, tracking

    where = f"storage_path {str(config.storage_path)!r}, name {name!r}"
    if not storage.is_dir(experiment_path):
        raise UserError(f"--resume: no sweep at {experiment_path} ({where}); run it without --resume first")
    if not Tuner.can_restore(experiment_path):
        held = ", ".join(storage.list_names(experiment_path)) or "nothing"
        raise UserError(f"--resume: {experiment_path} holds no Tune experiment to resume (only {held}: `probe` "
                        f"output?); run the sweep without --resume")
    parent = tracking.find_parent(tracking_uri, experiment_path)
    logged = tracking.spec_of(tracking_uri, parent.info.run_id)
    if logged is not None:
        changed = spec_changes(yaml.safe_load(logged) or {}, config.model_dump(mode="json"))
        if changed:
            raise UserError(
                f"--resume: the spec differs from the sweep's own (spec.yaml of MLflow run {parent.info.run_id}): "
                f"{'; '.join(changed)}. Tune resumes the sweep's search space and ASHA as they were, so trials would "
                f"run another spec: undo the change, or start a new sweep (another name)")
    if parent.info.status == "RUNNING" and drivers.driver_alive(parent.data.tags):
        tags = parent.data.tags
        raise UserError(f"--resume: this sweep's driver still runs (pid {tags['raysweep.driver.pid']} on "
                        f"{tags['raysweep.driver.host']}); stop it first (Ctrl-C), or wait for it")
    return parent.info.run_id


def resume_hint(experiment_path: str, spec: str, overrides: list[str]) -> str:
    """The command that resumes an interrupted or failed `tune` (given on the command line as `spec` and its --set
    `overrides`), where Tune saved the sweep at `experiment_path`; '' where it saved none (stopped before its first
    trial: nothing to resume, the command starts it anew)."""
    from ray.tune import Tuner

    from raysweep.config import command_args

    if not (storage.is_dir(experiment_path) and Tuner.can_restore(experiment_path)):
        return ""
    return f"python -m raysweep tune {command_args(spec, overrides, store_flag=False)} --resume"


def spec_changes(before: dict, after: dict) -> list[str]:
    """'key: old → new' for every key both specs hold whose value differs, but the ones a resume may change."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v and not set(v) & {"choice", "loguniform", "uniform", "randint"}:
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    old, new = dict(flat(before)), dict(flat(after))
    return [f"{k}: {old[k]!r} → {new[k]!r}" for k in old if k in new and old[k] != new[k]
            and k not in RESUME_MAY_CHANGE and not k.startswith(RESUME_IDENTITY)]


@dataclass(frozen=True)
class ResumeSummary:
    done: int  # trials that ended (finished, pruned or failed): not run again
    running: list[tuple[str, int]]  # (trial id, last reported epoch): continue from their own checkpoints
    pending: int  # not started yet


@dataclass(frozen=True)
class TakenOver:
    """A resumed sweep, as its new driver holds it."""

    experiment_id: str
    parent_run_id: str
    summary: ResumeSummary
    settled: dict  # trial id → how the store says it ended (tracking.settled_trials): relay.SweepContext.settled


def take_over(tracking_uri: str, parent_run_id: str, experiment_path: str, num_samples: int) -> TakenOver:
    """What is left (read before Tune restores the experiment), then the parent run RUNNING again under this
    driver."""
    from raysweep import tracking

    summary = resume_summary(experiment_path, num_samples)
    settled = tracking.settled_trials(tracking_uri, parent_run_id)
    experiment_id = tracking.resumed_parent(tracking_uri, parent_run_id)
    return TakenOver(experiment_id, parent_run_id, summary, settled)


def resume_summary(experiment_path: str, num_samples: int) -> ResumeSummary:
    """Tune's saved trial states, and for each unfinished trial the epoch of its newest checkpoint, where it
    continues (Tune's state, saved every few seconds, can trail it, or hold no result for a trial that did train)."""
    from ray.tune import ExperimentAnalysis

    from raysweep import layout

    trials = ExperimentAnalysis(experiment_path).trials
    ended = [t for t in trials if t.status in ("TERMINATED", "ERROR")]
    running = []
    for t in trials:
        if t in ended:
            continue
        epoch = layout.last_checkpoint_epoch(layout.trial_dir(storage.join(experiment_path, layout.TRAIN), t.trial_id))
        if epoch:  # a trial stopped by Ctrl-C is saved PENDING, but it has trained: it continues too
            running.append((t.trial_id, epoch))
    return ResumeSummary(len(ended), running, num_samples - len(ended) - len(running))
