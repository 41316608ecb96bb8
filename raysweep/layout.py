"""A sweep's folder, named once: the driver, the workers, `--resume` and the report all find their files through
these names (no module spells a folder or file name of its own).

    <storage_path>/<name>/                  the sweep's experiment folder (Tune's experiment state beside these)
        train/trial-<id>/                   a trial's own folder: raysweep's checkpoints and its clock
            checkpoint_<epoch:06d>/state.pt   the newest KEPT_CHECKPOINTS kept (worker/entry.save_checkpoint)
            clock.json                      the training seconds its latest epoch reached (read_clock)
        slots/slot-<n>/                     each warm group's Ray Train run (no checkpoints: trials keep theirs)
        compile_cache/                      torch.compile's artifacts, shared by every rank (worker/compile_cache.py)
        report/                             report.html, summary and plots (report.publish)
    <storage_path>/<name>/probe/probe-<time>/probe.json   `raysweep probe`'s table (PROBE_FILE)

No torch and no Ray here: `--resume` reads a trial's newest checkpoint epoch before anything starts.
"""

from __future__ import annotations

import json

from raysweep import storage

TRAIN, SLOTS, COMPILE_CACHE, REPORT, PROBE = "train", "slots", "compile_cache", "report", "probe"
CHECKPOINT_PREFIX = "checkpoint_"
CHECKPOINT_FILE = "state.pt"
KEPT_CHECKPOINTS = 2  # a trial's newest checkpoints kept: one torn by a kill or a full disk has a predecessor
CLOCK_FILE = "clock.json"
PROBE_FILE = "probe.json"


def trial_dir(train_storage: str, trial_id: str) -> str:
    """A trial's own folder under the sweep's `train/`: a trial run again (a restart, --resume) finds it by id."""
    return storage.join(train_storage, f"trial-{trial_id}")


def slot_name(slot_id: int) -> str:
    return f"slot-{slot_id}"


def checkpoint_name(epoch: int) -> str:
    return f"{CHECKPOINT_PREFIX}{epoch:06d}"


def checkpoint_names(run_dir: str) -> list[str]:
    """A trial's checkpoint folders, oldest first (their names sort by epoch)."""
    return sorted(n for n in storage.list_names(run_dir)
                  if n.startswith(CHECKPOINT_PREFIX) and n.removeprefix(CHECKPOINT_PREFIX).isdigit())


def last_checkpoint_epoch(run_dir: str) -> int:
    """The epoch of a trial's newest checkpoint folder (0: none), from its name alone."""
    names = checkpoint_names(run_dir)
    return int(names[-1].removeprefix(CHECKPOINT_PREFIX)) if names else 0


def write_clock(run_dir: str, epoch: int, train_seconds: float) -> None:
    """Rank 0, after an epoch that saved no checkpoint (train.checkpoint_every > 1), in a thread of its own
    (worker/entry.ClockWriter): the training seconds it reached. A restart goes back to the last checkpoint (or, with
    none yet, to the start) and trains the epochs after it again; their first run's seconds are in no checkpoint,
    and without this the clock would run backwards and the lost time vanish (read_clock)."""
    storage.write_bytes(storage.join(run_dir, CLOCK_FILE),
                        json.dumps({"epoch": epoch, "train_seconds": train_seconds}).encode())


def read_clock(run_dir: str) -> tuple[int, float]:
    """(epoch, training seconds) the trial's latest epoch reached, checkpointed or not; (0, 0.0): none written, or
    unreadable. A restored run's clock starts there (TrainingRun.restore): the epochs it trains again count on top,
    once, and the clock never runs backwards."""
    try:
        data = storage.read_bytes(storage.join(run_dir, CLOCK_FILE))
        clock = json.loads(data) if data else {}
        return int(clock.get("epoch", 0)), float(clock.get("train_seconds", 0.0))
    except (OSError, ValueError, TypeError):
        return 0, 0.0
