"""One rank's run of a trial: build, restore, fit in memory, and epochs (train, evaluate, reduce); the checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

from raysweep.config import TrialConfig
from raysweep.metrics import EpochMetrics, WorkerParams, reached, to_target
from raysweep.models import count_parameters
from raysweep.optim import build_scheduler
from raysweep.worker.device import device_name, release_host_memory
from raysweep.worker.evaluate import evaluate
from raysweep.worker.faults import TrialFailure
from raysweep.worker.net import RankModel
from raysweep.worker.probe_step import probe_step
from raysweep.worker.reduce import all_reduce_named, reduce_metrics
from raysweep.worker.shard import Shard, rank_shards
from raysweep.worker.step import train_one_epoch

log = logging.getLogger(__name__)


@dataclass
class TrainingRun:
    """One rank's model, schedule and data; `epoch()` trains, evaluates and reduces."""

    trial: TrialConfig
    net: RankModel
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train: Shard
    val: Shard
    rank: int
    samples_seen: int = 0
    downshifts: int = 0
    nodes: str = ""  # every rank's Ray node id, by rank
    last_report: dict | None = None  # what the restored checkpoint's epoch reported
    compile_reported_s: float = 0.0  # net.compile_s already reported
    epochs: int = 0  # the epochs this trial runs: train.epochs, or what fills train.time_budget_s (resolve_epochs)
    resolved: bool = False  # under a time budget: whether `epochs` has been fixed yet
    train_seconds: float = 0.0  # training seconds so far (EpochMetrics.train_seconds)
    target_point: tuple | None = None  # the last epoch's (train_seconds, epoch, samples_seen, target metric)
    to_target: tuple | None = None  # (seconds, epochs, samples) to tune.target, once reached

    @classmethod
    def build(cls, trial: TrialConfig, data, rank: int, world_size: int, device: torch.device, wrap=None,
              path: str | None = None, shards: tuple[Shard, Shard] | None = None) -> TrainingRun:
        """`path`: the model's path (RankModel.build). `shards`: (train, val) already on the device (a warm
        group's, built once for all its trials); None: cut from `data` now."""
        net = RankModel.build(trial, device, wrap, path=path)
        scheduler = build_scheduler(net.optimizer, trial.peak_lr, trial.train.min_lr, trial.warmup_steps,
                                    trial.total_steps)
        if shards is None:
            classes = trial.image.num_classes
            shards = rank_shards(data, classes, device, rank, world_size)
        return cls(trial, net, scheduler, *shards, rank, epochs=trial.train.epochs,
                   resolved=trial.train.time_budget_s is None)

    def restore(self, state: dict | None, clock: tuple[int, float] = (0, 0.0)) -> int:
        """Continue from a checkpoint's state (`entry.load_latest`) if there is one; returns the epoch to start at.
        `clock`: (epoch, training seconds) the trial's latest epoch reached (layout.read_clock). Past the checkpoint
        (train.checkpoint_every > 1), or with no checkpoint yet, the epochs after it are trained again: their first
        run is time the restart lost, so the clock goes on from where it had got to (those seconds, and the
        re-run's, each counted once) and never runs backwards: a time budget is not handed out again, and the time
        to a target counts what the trial cost."""
        if state is None:
            self.train_seconds = clock[1] if clock[0] > 0 else 0.0
            return 1
        self.net.core.load_state_dict(state["model"])
        load_optimizer_state(self.net.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.net.scaler.load_state_dict(state["scaler"])
        self.samples_seen = state["samples_seen"]
        self.last_report = state.get("report")
        self.train_seconds = state.get("train_seconds", 0.0)
        if clock[0] > state["epoch"]:
            self.train_seconds = max(self.train_seconds, clock[1])
        self.epochs, self.resolved = state.get("epochs", self.epochs), state.get("resolved", self.resolved)
        self.target_point, self.to_target = state.get("target_point"), state.get("to_target")
        if self.rank == 0:
            log.info("resumed from checkpoint at epoch %d", state["epoch"])
        return state["epoch"] + 1

    @property
    def micro_batch(self) -> int:
        """The micro-batch the epochs run: the per-GPU batch cut into micro_splits equal parts (shard.epoch_plan)."""
        return self.trial.micro_batch_size

    def fit_in_memory(self, proven: int = 0) -> None:
        """One probe step at the trial's micro-batch on every rank before training (with the compiled step, the
        compile happens here); on OOM halve the micro-batch and double accumulation (same global batch and LR),
        at most max_downshifts times.

        `proven`: the largest micro-batch this process has already trained (a warm group's earlier trial, same
        model, precision and world size): one no larger fits, and the probe is skipped (it leaves no trace on the
        run either way: probe_step.KeptState). A process that fragmented its memory since still OOMs in training:
        its group restarts, fresh, and probes again."""
        if self.micro_batch <= proven:
            return
        for shift in range(self.trial.train.max_downshifts + 1):
            micro = self.micro_batch
            if probe_step(self.net, self.trial, micro).fits:
                if shift and self.rank == 0:
                    log.warning("OOM at micro-batch %d: running %d × %d",
                                2 * micro, micro, self.trial.accumulation_steps)
                return
            if shift == self.trial.train.max_downshifts or not self.trial.can_downshift:
                break
            self.trial = self.trial.downshifted()
            self.downshifts += 1
        raise TrialFailure("oom", f"OOM at per-GPU batch {self.trial.knobs.per_gpu_batch_size} "
                                  f"(micro-batch {micro} after {self.downshifts} downshifts)")

    def state(self, epoch: int, reported: dict) -> dict:
        """The checkpoint: everything to continue after `epoch`, and what that epoch reported."""
        net = self.net
        return {"model": net.core.state_dict(), "optimizer": net.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": net.scaler.state_dict(), "epoch": epoch,
                "samples_seen": self.samples_seen, "report": reported, "train_seconds": self.train_seconds,
                "epochs": self.epochs, "resolved": self.resolved, "target_point": self.target_point,
                "to_target": self.to_target}

    def worker_params(self) -> WorkerParams:
        return WorkerParams(device_name(self.net.device), self.net.precision, self.micro_batch,
                            self.trial.accumulation_steps, self.downshifts, self.nodes, self.epochs,
                            count_parameters(self.net.core))

    def resolve_epochs(self, metrics: EpochMetrics, pace_s: float) -> None:
        """Under train.time_budget_s: the epochs (at most train.epochs, at least the ones run) whose training seconds
        fill the budget, at this epoch's pace (`pace_s`: its seconds, compiling excluded), and the cosine fitted to
        them. Estimated again after every epoch while the next one is still all warmup (the LR there does not depend
        on the end), so a warmup of several epochs times a later, steadier epoch; fixed once the next epoch reaches
        the cosine. Every rank computes it from the same reduced figures."""
        budget, trial = self.trial.train.time_budget_s, self.trial
        if self.resolved or budget is None:
            return
        left = budget - metrics.train_seconds
        fits = metrics.epoch + (math.floor(left / pace_s) if pace_s > 0 else trial.train.epochs)
        self.epochs = max(metrics.epoch, min(trial.train.epochs, fits))
        for schedule in self.scheduler.lr_lambdas:  # optim.WarmupCosine: the same steps, a new end
            schedule.total_steps = self.epochs * trial.steps_per_epoch
        self.resolved = (metrics.epoch + 1) * trial.steps_per_epoch > trial.warmup_steps
        if self.resolved and self.rank == 0:
            log.info("time budget %.0f s: %.2f s an epoch at epoch %d → %d epochs (train.epochs %d)", budget, pace_s,
                     metrics.epoch, self.epochs, trial.train.epochs)

    def watch_start(self) -> None:
        """tune.target, before the first step: the untrained model's value of the target's metric, so that a target
        reached in epoch 1 is interpolated from the start of training (0 s, 0 samples) like any other, and trials
        that reach it in their first epoch are told apart. One evaluation on every rank (its seconds are start-up,
        in no clock). train_loss reads the validation loss: an untrained model's loss on the training set has the
        same expectation. A value already at the target: reached at 0."""
        target = self.trial.target
        if target is None or self.target_point is not None or self.to_target is not None:
            return
        val = evaluate(self.net.core, self.val, self.trial, self.net.precision, self.net.channels_last)
        s = all_reduce_named({"loss": val.loss_sum, "samples": val.samples, "exact": val.exact, "chars": val.chars,
                              "char_total": val.char_total}, torch.distributed.ReduceOp.SUM, self.net.device)
        n = max(s["samples"], 1)
        value = {"val_loss": s["loss"] / n, "train_loss": s["loss"] / n, "val_exact_acc": s["exact"] / n,
                 "val_char_acc": s["chars"] / max(s["char_total"], 1)}[target.metric]
        # the clock starts where a restart before the first checkpoint left it (restore): 0 on a first start
        self.target_point = (self.train_seconds, 0.0, 0.0, value)
        if reached(value, target.value, target.mode):
            self.to_target = (self.train_seconds, 0.0, 0.0)

    def watch_target(self, metrics: EpochMetrics) -> EpochMetrics:
        """tune.target: once an epoch reaches it, the time to it (metrics.to_target) goes with every report."""
        target = self.trial.target
        if target is None:
            return metrics
        if self.to_target is None:
            value = getattr(metrics, target.metric)
            point = (metrics.train_seconds, float(metrics.epoch), float(metrics.samples_seen), value)
            if reached(value, target.value, target.mode):
                self.to_target = to_target(self.target_point, point, target.value)
            self.target_point = point
        if self.to_target is None:
            return metrics
        seconds, epochs, samples = self.to_target
        return dataclasses.replace(metrics, time_to_target_s=seconds, epochs_to_target=epochs,
                                   samples_to_target=samples)

    @property
    def stops_at_target(self) -> bool:
        """tune.target with stop: true, reached: the trial ends after this epoch's report."""
        return self.to_target is not None and self.trial.target is not None and self.trial.target.stop

    def epoch(self, epoch: int) -> EpochMetrics:
        """Train one epoch, evaluate, reduce across ranks."""
        device = self.net.device
        cuda = device.type == "cuda"
        # a fresh, epoch-derived seed: dropout and shuffling replay exactly after a resume
        torch.manual_seed(hash((self.trial.train.seed, epoch, self.rank)) & 0x7FFF_FFFF)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        compile_before = self.net.compile_s
        t0 = time.perf_counter()
        train = train_one_epoch(self.net, self.train, self.scheduler, self.trial, epoch, self.rank)
        if cuda:
            torch.cuda.synchronize(device)  # once per epoch: make the timing honest
        train_time_s = time.perf_counter() - t0
        val = evaluate(self.net.core, self.val, self.trial, self.net.precision, self.net.channels_last)
        epoch_time_s = time.perf_counter() - t0
        compile_s, self.compile_reported_s = self.net.compile_s - self.compile_reported_s, self.net.compile_s
        metrics = reduce_metrics(train, val, train_time_s=train_time_s, epoch_time_s=epoch_time_s,
                                 epoch=epoch, samples_before=self.samples_seen, lr=self.scheduler.get_last_lr()[0],
                                 device=device, compile_s=compile_s, seconds_before=self.train_seconds,
                                 work_time_s=epoch_time_s - (self.net.compile_s - compile_before))
        self.resolve_epochs(metrics, metrics.train_seconds - self.train_seconds)
        self.samples_seen, self.train_seconds = metrics.samples_seen, metrics.train_seconds
        metrics = self.watch_target(metrics)
        if not cuda:
            release_host_memory()
        return metrics


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`optimizer.load_state_dict`, keeping this optimizer's kind of LR (a device tensor when capturable, else a
    float) and its `capturable` flag: a checkpoint may come from a run that made the other choice."""
    kinds = [(isinstance(g["lr"], torch.Tensor), g.get("capturable", False)) for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, (tensor_lr, capturable) in zip(optimizer.param_groups, kinds, strict=True):
        lr = float(group["lr"])
        group["lr"] = torch.tensor(lr, dtype=torch.float32, device=group["params"][0].device) if tensor_lr else lr
        group["capturable"] = capturable
