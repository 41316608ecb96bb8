"""The ground truth benchmarks/answer_check.py holds a sweep's answer to: a grid of global batch × peak LR, each
cell trained for the same training seconds, in this process with raysweep's own rank code (worker.run.TrainingRun:
the model, the step, the schedule, evaluation), one rank, the threads a worker of the spec gets, every cell of a
batch for the same epochs: those that fill the training seconds at the batch's measured pace (the sweep's trials fit
theirs to train.time_budget_s, each from its own first epochs).

Per batch: a coarse pass over LRs 2× apart (one seed), then the √2 midpoints on both sides of its best, then a second
seed at its best three: the cells near the optimum are √2 apart and measured twice (the spread between seeds is
reported). The left-out batch, whose best LR the goal is held to, gets a window of five LRs √2 apart around its
coarse best, each on the same eight seeds (four on --gpu): on this CPU task each such cell's four seeds spread 9-21 %
while the seed-means from 2.83e-3 to 5.66e-3 lay within 0.7 % (benchmarks/RESULTS.md, 2026-12-02), so two seeds'
argmin places that best within 2× at most. Its best LR is the bottom of the parabola through the window's best
seed-mean and its two neighbours, resampled over the seeds, each drawn for every cell (bootstrap;
`resampled_bests`). A diverging cell is recorded as diverged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

RESAMPLES = 400  # bootstrap resamples of the left-out batch's seeds: how sure the grid is of its best LR
DIVERGED = math.inf  # a cell whose loss went non-finite: recorded, never the best


class Trainer:
    """Runs of the task in this process, as a rank of the spec trains them (one rank, the threads a worker of the
    spec gets, the data loaded once)."""

    def __init__(self, config, mode: dict):
        import torch

        from raysweep.data import load_data
        from raysweep.worker.device import setup_device

        self.config, self.mode = config, mode
        self.device = torch.device("cuda" if mode["gpu"] else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(mode["workers_cpus"])  # what a worker of the spec gets (OMP_NUM_THREADS)
        setup_device(self.device)
        self.data = load_data(config.data)
        self.epochs: dict[tuple[int, float], int] = {}  # the epochs each cell trained
        self.fixed: dict[int, int] = {}  # the epochs of every cell at a batch (epochs_for)

    def epochs_for(self, batch: int) -> int:
        """The epochs that fill the spec's training seconds at `batch`, from one pace run's steady epoch (its second:
        the first holds the warm-up of the kernels): the same for every cell of the batch, so the grid compares LRs
        at equal samples. A time budget fixed per run from its own first epochs varied 5 to 9 epochs at one batch."""
        if batch not in self.fixed:
            _, run = self._run(batch, 1e-3, None, 2)
            first, second = run.epoch(1), run.epoch(2)
            pace = max(second.train_seconds - first.train_seconds, 1e-6)
            self.fixed[batch] = max(1, min(self.config.train.epochs, round(self.mode["seconds"] / pace)))
            print(f"pace  batch {batch:>5}  {pace:.2f} s an epoch → {self.fixed[batch]} epochs a cell", flush=True)
        return self.fixed[batch]

    def _run(self, batch: int, lr: float, seed: int | None, epochs: int):
        """A rank's TrainingRun at (global batch, peak LR) for `epochs` epochs, no time budget."""
        from raysweep.worker.run import TrainingRun

        train = self.config.train.model_copy(update={"time_budget_s": None, "epochs": epochs})
        config = self.config.model_copy(update={"train": train})
        knobs = {"per_gpu_batch_size": batch, "base_lr": lr, **({"seed": seed} if seed is not None else {})}
        trial = config.trials.trial(knobs, len(self.data.train))
        run = TrainingRun.build(trial, self.data, 0, 1, self.device)
        run.restore(None)
        return trial, run

    def final_val_loss(self, batch: int, lr: float, seed: int | None = None, label: str = "grid") -> float:
        """One run at (global batch, peak LR) for the batch's epochs (`epochs_for`; `seed`: its train.seed, else the
        spec's): its last epoch's val_loss (inf where it diverged)."""
        trial, run = self._run(batch, lr, seed, self.epochs_for(batch))
        epoch, last = 1, None
        while epoch <= run.epochs:
            last = run.epoch(epoch)
            if not math.isfinite(last.val_loss):
                break
            epoch += 1
        value = last.val_loss if last is not None and math.isfinite(last.val_loss) else DIVERGED
        self.epochs[(batch, lr)] = last.epoch if last is not None else 0
        print(f"{label}  batch {batch:>5}  peak LR {lr:.2e}  seed {trial.train.seed}  {last.epoch:>4} epochs  "
              f"{last.train_seconds:6.1f} s  val_loss {value:.4f}", flush=True)
        return value

    def cell(self, batch: int, lr: float, seed: int | None = None, label: str = "grid") -> float:
        """final_val_loss, with a run that raised on divergence (worker.faults.TrialFailure) recorded as diverged."""
        from raysweep.worker.faults import TrialFailure

        try:
            return self.final_val_loss(batch, lr, seed, label)
        except TrialFailure as e:
            print(f"{label}  batch {batch:>5}  peak LR {lr:.2e}  seed {seed}  diverged ({e})", flush=True)
            return DIVERGED


class Earlier:
    """An earlier run's grid (`--grid`: its --out JSON), as the report reads a Trainer's: the cells' epochs."""

    def __init__(self, epochs: dict, fixed: dict):
        self.epochs, self.fixed = epochs, fixed

    @classmethod
    def load(cls, path: str) -> tuple[Earlier, dict[tuple[int, float], list[float]]]:
        figures = json.loads(Path(path).read_text())

        def key(text: str) -> tuple[int, float]:
            batch, lr = text.split()
            return int(batch), float(lr)

        truth = {key(k): v for k, v in figures["grid"].items()}
        epochs = {key(k): e for k, e in figures["grid_epochs"].items()}
        return cls(epochs, {int(b): e for b, e in figures["grid_batch_epochs"].items()}), truth


def grid(trainer: Trainer, mode: dict) -> dict[tuple[int, float], list[float]]:
    """{(global batch, peak LR): [final val_loss per seed]}: the coarse LRs on the first seed; the √2 midpoints
    around each batch's coarse best; the other seeds at its best three; at the left-out batch, a window of LRs √2
    apart around its coarse best, each on every one of `left_seeds` (the module's docstring)."""
    first, *others = mode["seeds"]
    cells: dict[tuple[int, float], list[float]] = {}
    for batch in mode["batches"]:
        for lr in mode["lrs"]:
            cells[(batch, lr)] = [trainer.cell(batch, lr, first)]
        coarse = min(mode["lrs"], key=lambda lr: cells[(batch, lr)][0])
        if batch == mode["left_out"]:
            for lr in window(cells, batch, coarse, mode["window"]):
                if (batch, lr) not in cells:
                    cells[(batch, lr)] = [trainer.cell(batch, lr, mode["left_seeds"][0], "fine")]
                cells[(batch, lr)] += [trainer.cell(batch, lr, seed, "seed") for seed in mode["left_seeds"][1:]]
            continue
        for lr in (coarse / math.sqrt(2), coarse * math.sqrt(2)):
            cells[(batch, lr)] = [trainer.cell(batch, lr, first, "fine")]
        mine = sorted((k for k in cells if k[0] == batch), key=lambda k: cells[k][0])[:3]
        for key in mine:
            cells[key] += [trainer.cell(*key, seed, "seed") for seed in others]
    return cells


def window(cells: dict, batch: int, center: float, size: int) -> list[float]:
    """`size` peak LRs √2 apart centred on `center`, each the grid's own where it has one that close (a float key
    reused, never a second cell at the same LR)."""
    lrs = []
    for k in range(-(size // 2), size // 2 + 1):
        lr = center * math.sqrt(2) ** k
        lrs.append(next((x for b, x in cells if b == batch and abs(math.log(x / lr)) < 1e-6), lr))
    return lrs


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def best_lr(values: dict[float, float]) -> tuple[float, float]:
    """A batch's best grid LR: (the argmin, the vertex of the parabola in log LR through it and its neighbours; the
    argmin itself at the grid's edge)."""
    lrs = sorted(values)
    i = min(range(len(lrs)), key=lambda k: values[lrs[k]])
    if i in (0, len(lrs) - 1) or not all(math.isfinite(values[lrs[k]]) for k in (i - 1, i, i + 1)):
        return lrs[i], lrs[i]
    around = (i - 1, i, i + 1)
    (x0, x1, x2), (y0, y1, y2) = (math.log(lrs[k]) for k in around), (values[lrs[k]] for k in around)
    denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
    return lrs[i], math.exp(-b / (2 * a)) if a > 0 else lrs[i]


def window_best(means: dict[float, float]) -> float:
    """The best LR of the left-out batch's window: `best_lr`'s parabola through the argmin of its cells' seed-means
    and its two neighbours (the argmin itself at the window's edge). Not a least-squares parabola through every
    cell: the bowl is asymmetric (its cliff at 8e-3, seeds 0.146 to 0.196 on one cell), and a parabola through the
    cliff puts the bottom left of the flat cells (3.4e-3 where 2.83e-3, 4e-3 and 5.66e-3 were 0.1408, 0.1398 and
    0.1398)."""
    return best_lr({lr: v for lr, v in means.items() if math.isfinite(v)})[1]


def resampled_bests(cells: dict[float, list[float]], seed: int = 0) -> list[float]:
    """window_best over RESAMPLES bootstrap resamples of the seeds (the first: the cells as measured). Every cell
    holds the same seeds in the same order (`left_seeds`: the same initial weights and data order at each LR), so a
    resample draws seeds, each for the whole window: a seed's own level, shared by every LR, moves every seed-mean
    alike and not the best LR. Drawn cell by cell, that level would count as noise between LRs: on run 2's window
    (benchmarks/RESULTS.md, 2026-12-02; seed 3 the worst at four of five LRs) 90 % of the bests spread 1.78×
    cell by cell, 1.51× seed by seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = [window_best({lr: mean(v) for lr, v in cells.items()})]
    seeds = {len(v) for v in cells.values()}
    if len(seeds) != 1:
        raise ValueError(f"the window's cells hold {sorted(seeds)} seeds: each must hold every one of left_seeds")
    n = seeds.pop()
    if n < 2:
        return out  # one seed: nothing to resample
    for _ in range(RESAMPLES):
        drawn = rng.integers(0, n, n)
        out.append(window_best({lr: float(np.mean(np.asarray(v)[drawn])) for lr, v in cells.items()}))
    return out
