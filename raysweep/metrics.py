"""Metric and param names (API: MLflow keys, Tune metrics, summary columns), listed once, here; the
typed records that carry them; and the one rule that reads a trial's outcome, with its one encoding in MLflow
(a run's status and tags: `run_ending` writes it, `outcome_of_run` reads it back).

Imports nothing from raysweep and nothing heavy: the worker, the driver and the console all use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple


@dataclass(frozen=True)
class EpochMetrics:
    """One epoch of one trial, reduced across ranks (sums, or max for the *_max / memory / time ones)."""

    epoch: int  # epochs completed (1-based); ASHA's time attribute and the MLflow step
    samples_seen: int  # training samples consumed so far, all ranks
    train_loss: float  # mean multi-label soft-margin loss over the epoch's training samples
    val_loss: float  # mean loss on the validation split
    val_exact_acc: float  # share of validation captchas with every character right
    val_char_acc: float  # share of validation characters right
    lr: float  # learning rate after the epoch's last optimizer step
    grad_norm: float  # mean pre-clip global gradient norm over the epoch's optimizer steps
    grad_norm_max: float  # largest pre-clip global gradient norm in the epoch
    clip_fraction: float  # share of optimizer steps whose norm exceeded train.grad_clip
    epoch_time_s: float  # wall seconds of the epoch (train + validation), slowest rank
    samples_per_s: float  # global training throughput: samples ÷ slowest rank's training seconds
    peak_mem_allocated_gb: float  # CUDA allocator peak allocated in the epoch, GiB, max over ranks (0 on CPU)
    peak_mem_reserved_gb: float  # CUDA allocator peak reserved in the epoch, GiB, max over ranks (0 on CPU)
    rss_gb: float  # resident memory of the worker process at epoch end, GiB, max over ranks
    # seconds this epoch (start-up included in the first) spent compiling the step: torch.compile's first call at
    # each shape (the probe step's or training's) and CUDA graph capture; max over ranks; 0 when nothing compiled
    compile_s: float = 0.0
    # training seconds so far, start-up excluded: every epoch's epoch_time_s but the compile time inside it (the
    # probe step's compile is start-up too); cumulative and monotonic, kept in the checkpoint: ASHA's clock when
    # tune.asha.unit is seconds, and the time in time_to_target_s
    train_seconds: float = 0.0
    # the gradient noise scale (noise.py), from the epoch's steps; absent (None) where nothing was measured
    grad_noise_scale: float | None = None  # B_noise = tr(Σ) / |G|², samples: the batch past which growth stops paying
    grad_sq_norm: float | None = None  # |G|², the true gradient's squared norm (epoch mean of the estimate)
    grad_trace_cov: float | None = None  # tr(Σ), per-example gradient variance summed over parameters (epoch mean)
    # tune.target reached (worker/run.TrainingRun.watch_target): how long it took, interpolated between the two
    # epochs that straddle the value (in the first epoch: from the start of training, whose value one evaluation
    # of the untrained model gives, TrainingRun.watch_start); in every report from that epoch on
    time_to_target_s: float | None = None  # training seconds (train_seconds' clock)
    epochs_to_target: float | None = None  # epochs, fractional
    samples_to_target: float | None = None  # training samples, all ranks


@dataclass(frozen=True)
class WorkerParams:
    """What only the workers know (after their start-up probe step): logged as MLflow params once."""

    device_name: str  # e.g. "NVIDIA A100-SXM4-80GB" or "cpu (1 threads)"
    precision_used: str  # train.precision resolved (auto → bf16 or fp32)
    micro_batch_size: int  # samples per forward/backward on one rank
    accumulation_steps: int  # micro-batches per optimizer step on one rank
    oom_downshifts: int  # times the start-up probe halved the micro-batch
    nodes: str  # Ray node ids of the trial's workers, by rank, comma-separated (one machine's raylets share an IP)
    resolved_epochs: int  # the epochs the trial runs: train.epochs, or under train.time_budget_s what fills the budget
    model_parameters: int  # trainable parameters of the model the ranks built (reported as MODEL_PARAMETERS)

    KEYS = {"model_parameters": "model.parameters"}  # a field reported (and logged) under another name

    def reported(self) -> dict[str, Any]:
        """The params as reported and logged (WORKER_PARAMS names)."""
        return {self.KEYS.get(k, k): v for k, v in asdict(self).items()}


# A trial's start-up, from Tune starting it to its first training step (relay.run_trial, worker/entry.slot_worker):
# wall-clock stamps taken in this order, each phase named by the stamp that ends it. On a warm group the group and
# data phases take no time: their stamps are the moment the slot took the trial. Logged with the first epoch.
STARTUP_PHASES = (
    ("startup_driver_s", "relay_started"),  # Tune's trial actor up and running the trial function
    ("startup_wait_s", "slot_asked"),  # for a slot: a warm one to finish its epoch, or Ray Train asked for a group
    ("startup_group_s", "group_started"),  # placement group, worker processes, imports, process group (NCCL/gloo)
    ("startup_data_s", "data_ready"),  # the device set up, the data from the object store onto the device
    ("startup_model_s", "model_ready"),  # model, optimizer and schedule built, the trial's checkpoint restored
    ("startup_probe_s", "probed"),  # the OOM probe step (and with it, a compiled step's first compile)
)
STARTUP_NAMES = ("startup_s", *(name for name, _ in STARTUP_PHASES))  # startup_s: trial start → first step


def startup_phases(stamps: dict[str, float]) -> dict[str, float]:
    """`startup_s` = stamps["probed"] − stamps["trial_started"], and each phase's seconds: its stamp minus the one
    before (they sum to startup_s). Stamps come from several processes (and machines): a phase that two clocks
    make negative by a little counts as 0, and the next one is measured from the later stamp."""
    phases, previous = {}, stamps["trial_started"]
    for name, stamp in STARTUP_PHASES:
        phases[name] = max(0.0, stamps[stamp] - previous)
        previous = max(previous, stamps[stamp])
    phases["startup_s"] = sum(phases.values())
    return phases


METRIC_NAMES = tuple(f.name for f in fields(EpochMetrics))
WORKER_PARAMS = tuple(WorkerParams.KEYS.get(f.name, f.name) for f in fields(WorkerParams))
# the model a run trained (models.py): its factory, the keyword arguments it was called with (JSON), its trainable
# parameters; a sweep's parent run holds all three (the check before Ray), each trial's run too (the ranks' count)
MODEL_FACTORY, MODEL_KWARGS, MODEL_PARAMETERS = "model.factory", "model.kwargs", "model.parameters"
# in a report once the trial's compiled step ran eager anywhere: its value is why (EAGER_REASONS); MLflow tag
# `raysweep.eager_fallback` says it, and so does a warning on the console (worker/compile_cache.py sizes the limits)
EAGER_FALLBACK = "eager_fallback"
RECOMPILE_LIMIT, COMPILE_FAILED, CAPTURE_FAILED = 1, 2, 3
EAGER_REASONS = {RECOMPILE_LIMIT: "Dynamo hit a recompile limit",
                 COMPILE_FAILED: "the model could not be compiled (torch.compile raised; the rank's log says why)",
                 CAPTURE_FAILED: "the step could not be captured as a CUDA graph (the rank's log says why)"}


def eager_reason(value) -> str:
    """What an EAGER_FALLBACK value says (an older run's 1: the recompile limit)."""
    return EAGER_REASONS.get(int(value), EAGER_REASONS[RECOMPILE_LIMIT])
# the metrics a sweep can rank by, each with the direction that is better (`tune.mode` must agree)
METRIC_MODES = {"val_loss": "min", "val_exact_acc": "max", "val_char_acc": "max", "train_loss": "min"}
RANKABLE_METRICS = tuple(METRIC_MODES)
# a trial's MLflow params: its knobs and the values derived from them (config.TrialConfig.params builds them)
TRIAL_PARAMS = ("per_gpu_batch_size", "base_lr", "warmup_epochs", "weight_decay", "grad_accum_steps", "lr_rule",
                "global_batch_size", "peak_lr", "steps_per_epoch", "samples_per_epoch", "warmup_steps", "total_steps",
                "world_size",
                "precision", "epochs", "train_size", "reference_batch_size", "min_lr", "grad_clip", "seed",
                MODEL_FACTORY, MODEL_KWARGS)


class Names:
    """Every metric and param name above as an attribute holding itself (`names.val_loss == "val_loss"`): the
    driver reads results, runs and records through it, so a name that is not API fails where it is read."""

    def __init__(self, *groups: tuple[str, ...]):
        for group in groups:
            self.__dict__.update((name, name) for name in group)

    def __getattr__(self, name: str) -> str:  # only for names not set in __init__
        raise AttributeError(f"{name!r} is not a metric or param name (raysweep/metrics.py lists them)")


names = Names(METRIC_NAMES, WORKER_PARAMS, STARTUP_NAMES, TRIAL_PARAMS, (EAGER_FALLBACK,))


def report_dict(metrics: EpochMetrics, params: WorkerParams) -> dict[str, Any]:
    """The one dict handed to `ray.train.report`: plain numbers and strings, named as above (absent
    values left out, so that no tracker records a missing estimate as 0)."""
    return {k: v for k, v in {**asdict(metrics), **params.reported()}.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# Reading trials on the driver


TARGET_NAMES = ("time_to_target_s", "epochs_to_target", "samples_to_target")


# How a trial stands, one vocabulary for Tune's trials (TrialView) and the store's runs (RunRecord): it ended
# finished, pruned by ASHA or failed (Horizon.outcome); in the store, also interrupted (its sweep stopped before
# it ended: `tune --resume` goes on with it) or still running. OUTCOMES is the order counts are shown in.
FINISHED, PRUNED, FAILED, INTERRUPTED, RUNNING = "finished", "pruned", "failed", "interrupted", "running"
OUTCOMES = (FINISHED, PRUNED, FAILED, INTERRUPTED, RUNNING)
# the tags of a trial's MLflow run that say how it ended (run_ending writes them, outcome_of_run reads them)
TAG_STOPPED_BY, TAG_STOPPED_AT_EPOCH = "stopped_by", "stopped_at_epoch"  # pruned: "asha", and its last epoch
TAG_FAILURE, TAG_ERROR = "failure", "error"  # failed: its kind (failures.KINDS), and the error's telling line
TAG_INTERRUPTED = "interrupted"  # "true": its sweep stopped before it ended (Ctrl-C, a lost driver's sweep)
ENDING_TAGS = (TAG_STOPPED_BY, TAG_STOPPED_AT_EPOCH, TAG_FAILURE, TAG_ERROR, TAG_INTERRUPTED)  # run_ending's, all
TAG_BASELINE = "raysweep.baseline"  # "true" on the baseline's run (the spec's defaults)
# an error line is cut to this, below the longest tag value MLflow takes (MAX_TAG_VAL_LENGTH in
# mlflow/utils/validation.py: 8000 in MLflow 3)
ERROR_TAG_CHARS = 5000


@dataclass(frozen=True)
class Horizon:
    """Where a sweep's trials end on their own (config.SweepConfig.horizon): ASHA's max_t in its time attribute
    (`epoch`, or `train_seconds`), the end of a trial's own epochs, and with tune.target's `stop` the target."""

    time_attr: str = "epoch"
    max_t: float = float("inf")
    stop_at_target: bool = False

    def outcome(self, last: dict, errored: bool) -> str:
        """How a trial that is no longer running ended: failed, finished (it ran all its epochs, reached max_t or,
        where the target stops trials, the target) or pruned (cut by ASHA). `last`: its last reported result."""
        if errored:
            return FAILED
        done = (float(last.get(self.time_attr, 0)) >= self.max_t
                or int(last.get("epoch", 0)) >= int(last.get("resolved_epochs", 1 << 62))
                or (self.stop_at_target and last.get("time_to_target_s") is not None))
        return FINISHED if done else PRUNED


class RunEnding(NamedTuple):
    """How a trial's MLflow run ends: its final status and the tags that say why (`status, tags = run_ending(...)`)."""

    status: str  # FINISHED | KILLED | FAILED
    tags: dict[str, str]


def run_ending(outcome: str, epoch: int = 0, failure: str | None = None, error: str | None = None) -> RunEnding:
    """An outcome (Horizon.outcome, or interrupted) as its MLflow run ends, the one encoding of it: finished →
    FINISHED; pruned → KILLED tagged stopped_by=asha and stopped_at_epoch=`epoch`; interrupted → KILLED tagged
    interrupted=true (and error=`error` if given: why its sweep stopped); failed → FAILED tagged error=`error` (its
    line, cut to ERROR_TAG_CHARS) and failure=`failure` (its kind). `outcome_of_run` reads it back; a run reopened
    for --resume loses every tag of ENDING_TAGS (tracking.reopen)."""
    if outcome == FINISHED:
        return RunEnding("FINISHED", {})
    if outcome == PRUNED:
        return RunEnding("KILLED", {TAG_STOPPED_BY: "asha", TAG_STOPPED_AT_EPOCH: str(epoch)})
    if outcome == INTERRUPTED:
        return RunEnding("KILLED", {TAG_INTERRUPTED: "true", **({TAG_ERROR: error[:ERROR_TAG_CHARS]} if error else {})})
    if outcome == FAILED and failure is not None and error is not None:
        return RunEnding("FAILED", {TAG_ERROR: error[:ERROR_TAG_CHARS], TAG_FAILURE: str(failure)})
    raise ValueError(f"run_ending: no run ending for outcome {outcome!r} (failure {failure!r}, error {error!r}); "
                     f"give finished, pruned, or failed with its failure kind and error line")


def outcome_of_run(status: str, tags: dict) -> str:
    """A trial's outcome from its MLflow run's status and tags (what run_ending wrote): FINISHED → finished,
    FAILED → failed, RUNNING → running; any other (KILLED) → pruned where ASHA stopped it, else interrupted (its
    sweep was stopped: tracking's end_sweep)."""
    known = {"FINISHED": FINISHED, "FAILED": FAILED, "RUNNING": RUNNING}
    if status in known:
        return known[status]
    return PRUNED if tags.get(TAG_STOPPED_BY) == "asha" else INTERRUPTED


def outcome_counts(trials) -> dict[str, int]:
    """{outcome: how many of `trials` (anything with a `.status`: RunRecord, TrialView) stand so}, for every
    outcome of OUTCOMES in its order, zeros included."""
    statuses = [t.status for t in trials]
    return {outcome: statuses.count(outcome) for outcome in OUTCOMES}


def reached(value: float, target: float, mode: str) -> bool:
    """Whether a metric's value is at or past a target (mode: the metric's better direction)."""
    return value >= target if mode == "max" else value <= target


def to_target(before: tuple[float, ...] | None, after: tuple[float, ...], target: float) -> tuple[float, ...]:
    """(seconds, epochs, samples) to a target from two epochs' (seconds, epochs, samples, value): linearly
    interpolated between `before` (not reached; the start of training, (0, 0, 0, the untrained value), for the first
    epoch) and `after` (reached); no `before` (a checkpoint from before the start was measured): `after`'s own
    figures."""
    if before is None or after[3] == before[3]:
        return after[:3]
    f = (target - before[3]) / (after[3] - before[3])
    f = min(max(f, 0.0), 1.0)
    return tuple(b + f * (a - b) for b, a in zip(before[:3], after[:3]))


def rank_key(value, metric: str, mode: str, target: bool):
    """Sort key for ranking a trial, best first (`value(name)`: its last value of a metric, or None): with a
    target, the trials that reached it by time_to_target_s, then the rest by the metric; else by the metric.
    None: not rankable (no metric)."""
    if target and value("time_to_target_s") is not None:
        return (0, value("time_to_target_s"))
    v = value(metric)
    if v is None:
        return None
    return (1, -v if mode == "max" else v)


def rank(items: list, value_of, metric: str, mode: str, target: bool = False) -> list:
    """`items` that have a rank key (`value_of(item, name)`), best first."""
    keyed = [(rank_key(lambda n, i=i: value_of(i, n), metric, mode, target), n, i) for n, i in enumerate(items)]
    return [i for key, _, i in sorted((k for k in keyed if k[0] is not None), key=lambda k: (k[0], k[1]))]


def seconds_to_value(history: dict, metric: str, value: float, mode: str) -> float | None:
    """Training seconds at which a run's metric first reached `value` (`history`: metric name → {epoch: value}, with
    train_seconds), interpolated between the epochs around it (the first epoch's own seconds where it already did);
    None: never."""
    clock, values = history.get("train_seconds") or {}, history.get(metric) or {}
    before = None
    for epoch in sorted(e for e in values if e in clock):
        now = (clock[epoch], values[epoch])
        if reached(now[1], value, mode):
            if before is None or before[1] == now[1]:
                return now[0]
            f = min(max((value - before[1]) / (now[1] - before[1]), 0.0), 1.0)
            return before[0] + f * (now[0] - before[0])
        before = now
    return None


@dataclass(frozen=True)
class ConfirmationRecord:
    """A `raysweep confirm` of one of a sweep's recipes as the store holds it (tracking.load_sweep): each seed's run
    and what it measured, beside what the recipe was predicted to reach (answer.Expected's fields)."""

    parent_run_id: str
    global_batch: int
    peak_lr: float
    predicted: dict  # metric, value, time_to_target_s, samples, seconds, source
    runs: list  # per seed: trial_id, seed, status, epoch, value, time_to_target_s, train_seconds, seconds_to_value

    @property
    def finished(self) -> list:
        """The seeds' runs that ran their whole budget: the only ones a measurement counts (a diverged, stopped or
        still running seed's last value is not the budget's)."""
        return [r for r in self.runs if r.get("status") == FINISHED]

    @property
    def complete(self) -> bool:
        """Every seed finished (none failed, was stopped or is still running)."""
        return bool(self.runs) and len(self.finished) == len(self.runs)

    def measured(self, key: str) -> float | None:
        """The mean over the finished seeds' runs of a figure (`value`, `time_to_target_s`, `seconds_to_value`);
        None without a finished seed, or when one lacks it (a seed that never reached the target: the mean would
        hide it)."""
        values = [r.get(key) for r in self.finished]
        return sum(values) / len(values) if values and all(v is not None for v in values) else None

    def as_dict(self) -> dict:
        return {"parent_run_id": self.parent_run_id, "global_batch": self.global_batch, "peak_lr": self.peak_lr,
                "predicted": self.predicted, "runs": self.runs, "complete": self.complete,
                "seeds_counted": [r.get("seed") for r in self.finished],
                "measured": {k: self.measured(k) for k in ("value", "time_to_target_s", "seconds_to_value")}}


@dataclass(frozen=True)
class TrialView:
    """A Tune trial (live `Trial` or a `Result` of the grid) as the driver reads it."""

    trial_id: str
    status: str  # pending | running | paused | finished | pruned | failed
    config: dict  # the sampled knobs (Tune's flat dict)
    last: dict  # the last reported result ({} before the first)
    error: str | None = None  # failed: the most telling line of the error

    @property
    def epoch(self) -> int:
        return int(self.last.get("epoch", 0))

    def value(self, name: str) -> float | None:
        """The last reported value of a metric, or None."""
        value = self.last.get(name)
        return None if value is None else float(value)

    @classmethod
    def of_trial(cls, trial, horizon: Horizon, ended: str | None = None) -> TrialView:
        """From a live `ray.tune.experiment.Trial`. `ended`: "complete" or "error" inside those Tune
        callbacks, which run while the trial's status still says RUNNING."""
        last = dict(trial.last_result or {})
        status = trial.status.lower()
        errored = ended == "error" if ended else status == "error"
        if ended or status in ("terminated", "error"):
            status = horizon.outcome(last, errored)
        return cls(trial.trial_id, status, dict(trial.config), last, _trial_error_line(trial) if errored else None)


WORKER_DEATH = ("worker process has died", "died unexpectedly", "A worker health check failed")


def error_line(text: str) -> str:
    """The most telling line of an error text (the root cause, not Tune's wrapper)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    # a killed or crashed worker surfaces as whichever rank noticed first (a failed health check, or a
    # collective's "connection closed by peer" on the others): name the cause, not the symptom
    death = next((ln for ln in lines if any(s in ln for s in WORKER_DEATH)), None)
    if death is not None:
        return f"worker died: a training worker process was killed or crashed ({death[:300]})"
    for i in range(len(lines) - 1, -1, -1):  # the innermost exception's message comes last
        line = lines[i]
        if ("Error" in line or "Exception" in line) and ":" in line and not line.startswith("File "):
            if line.endswith(":") and i + 1 < len(lines):  # "...controller error:" + the reason below
                line = f"{line} {lines[i + 1]}"
            return line
    return lines[-1] if lines else "unknown error"


def _trial_error_line(trial) -> str:
    """A live trial's error: Tune keeps the full traceback in the trial's error file."""
    from pathlib import Path

    text = ""
    try:
        error_file = getattr(trial, "error_file", None)
        if error_file and Path(error_file).is_file():
            text = Path(error_file).read_text()
    except OSError:
        pass
    return error_line(text or str(getattr(trial, "error_msg", "") or ""))


# ---------------------------------------------------------------------------------------------
# A sweep as the MLflow store holds it (tracking.load_sweep reads it; report/ draws it)


@dataclass
class RunRecord:
    """One trial's child run."""

    run_id: str
    trial_id: str
    status: str  # an outcome of OUTCOMES (outcome_of_run)
    params: dict  # MLflow params (strings): knobs, derived values, worker params
    history: dict  # metric name → {epoch: value}
    tags: dict
    wall_s: float | None  # the run's start to end (None while running)
    baseline: bool = False  # the spec's defaults: the trial every other is compared with

    @property
    def epoch(self) -> int:
        return max(self.history.get("epoch", {}), default=0)

    @property
    def failure(self) -> str | None:
        """Failed: its kind (failures.KINDS), from the run's tag."""
        return self.tags.get(TAG_FAILURE)

    @property
    def error(self) -> str | None:
        """Failed: the most telling line of its error, from the run's tag."""
        return self.tags.get(TAG_ERROR)

    def last(self, name: str) -> float | None:
        values = self.history.get(name) or {}
        return values[max(values)] if values else None

    def number(self, param: str) -> float | None:
        try:
            return float(self.params[param])
        except (KeyError, ValueError):
            return None


@dataclass
class SweepRecord:
    tracking_uri: str
    experiment: str
    experiment_id: str
    parent_run_id: str
    parent_name: str
    metric: str  # the ranking metric (tune.metric) and its mode
    mode: str
    spec_text: str
    trials: list  # RunRecord, by start time
    # tune.target (metric, value): trials that reach it rank by time_to_target_s
    target: tuple[str, float] | None = None
    # `raysweep confirm` runs of this sweep's recipes (ConfirmationRecord), oldest first (tracking.load_sweep)
    confirmations: list = field(default_factory=list)

    def target_label(self) -> str:
        """e.g. `val_exact_acc ≥ 0.7` (the table headers)."""
        if self.target is None:
            return ""
        metric, value = self.target
        return f"{metric} {'≥' if METRIC_MODES.get(metric, 'max') == 'max' else '≤'} {value:g}"
