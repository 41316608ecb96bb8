"""One rank's run of a trial: build, restore, fit in memory, and epochs (train, evaluate, reduce); the checkpoint."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from raysweep.config import TrialConfig
from raysweep.metrics import EpochMetrics, WorkerParams
from raysweep.optim import build_scheduler
from raysweep.worker.device import device_name, release_host_memory
from raysweep.worker.evaluate import evaluate
from raysweep.worker.faults import TrialFailure
from raysweep.worker.net import RankModel
from raysweep.worker.probe_step import probe_step
from raysweep.worker.reduce import reduce_metrics
from raysweep.worker.shard import Shard
from raysweep.worker.step import train_one_epoch

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "state.pt"
KEPT_CHECKPOINTS = 2  # a trial's newest checkpoints kept: one torn by a kill or a full disk has a predecessor


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
            shards = (Shard.build(data.train, rank, world_size, classes, device),
                      Shard.build(data.val, rank, world_size, classes, device))
        return cls(trial, net, scheduler, *shards, rank)

    def restore(self, state: dict | None) -> int:
        """Continue from a checkpoint's state (`entry.load_latest`) if there is one; returns the epoch to start at."""
        if state is None:
            return 1
        self.net.core.load_state_dict(state["model"])
        load_optimizer_state(self.net.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.net.scaler.load_state_dict(state["scaler"])
        self.samples_seen = state["samples_seen"]
        self.last_report = state.get("report")
        if self.rank == 0:
            log.info("resumed from checkpoint at epoch %d", state["epoch"])
        return state["epoch"] + 1

    @property
    def micro_batch(self) -> int:
        """The micro-batch the epochs run: the shard cut into equal micro-batches (shard.epoch_plan)."""
        return len(self.train) // self.trial.micro_batches_per_epoch

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
                    log.warning("OOM at micro-batch %d: running %d × %d", 2 * micro, micro, self.trial.accumulation_steps)
                return
            if shift == self.trial.train.max_downshifts or micro == 1:
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
                "samples_seen": self.samples_seen, "report": reported}

    def worker_params(self) -> WorkerParams:
        return WorkerParams(device_name(self.net.device), self.net.precision, self.micro_batch,
                            self.trial.accumulation_steps, self.downshifts, self.nodes)

    def epoch(self, epoch: int) -> EpochMetrics:
        """Train one epoch, evaluate, reduce across ranks."""
        device = self.net.device
        cuda = device.type == "cuda"
        # a fresh, epoch-derived seed: dropout and shuffling replay exactly after a resume
        torch.manual_seed(hash((self.trial.train.seed, epoch, self.rank)) & 0x7FFF_FFFF)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        train = train_one_epoch(self.net, self.train, self.scheduler, self.trial, epoch, self.rank)
        if cuda:
            torch.cuda.synchronize(device)  # once per epoch: make the timing honest
        train_time_s = time.perf_counter() - t0
        val = evaluate(self.net.core, self.val, self.trial, self.net.precision)
        compile_s, self.compile_reported_s = self.net.compile_s - self.compile_reported_s, self.net.compile_s
        metrics = reduce_metrics(train, val, train_time_s=train_time_s, epoch_time_s=time.perf_counter() - t0,
                                 epoch=epoch, samples_before=self.samples_seen, lr=self.scheduler.get_last_lr()[0],
                                 device=device, compile_s=compile_s)
        self.samples_seen = metrics.samples_seen
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
