"""Rules that hold on every path, not only the common one: a trial's target and its clock across a restore (one
CPU process, the real TrainingRun and epoch loop), the folder layout named once."""

import pytest
import torch
from test_loop_pieces import _random_arrays, _trial

from raysweep.config import TargetConfig, TrainConfig
from raysweep.data import CaptchaData
from raysweep.worker.entry import train_epochs
from raysweep.worker.run import TrainingRun

# 96 random images, the validation set the training set: the untrained val_loss is 0.693, after epochs 1-3 it is
# 0.276, 0.168, 0.139 (seed 0)
DATA = CaptchaData(_random_arrays(96), _random_arrays(96), "random")


def _run(trial) -> TrainingRun:
    torch.manual_seed(0)
    return TrainingRun.build(trial, DATA, 0, 1, torch.device("cpu"))


def _target_trial(value, stop=True, epochs=3, checkpoint_every=1):
    return _trial().model_copy(update={"target": TargetConfig(metric="val_loss", value=value, stop=stop),
                                       "train": TrainConfig(epochs=epochs, checkpoint_every=checkpoint_every)})


def _epochs(run, start, checkpoints):
    """train_epochs with a send that keeps what the slot's sender would checkpoint (by epoch); returns the sends."""
    sent = []

    def send(payload, epoch):
        sent.append((epoch, payload))
        if epoch is not None and (epoch % run.trial.train.checkpoint_every == 0 or epoch >= run.epochs
                                  or run.stops_at_target):
            checkpoints[epoch] = run.state(epoch, payload)
        return True

    trained, failure = train_epochs(run, start, send, None)
    assert failure is None
    return sent


def test_a_trial_restored_after_it_stopped_at_its_target_trains_no_further():
    """tune.target with stop: the trial ends at the epoch that reached it (2 here). Restored from that checkpoint
    (its group restarted, an infra retry, --resume before the store marked it finished), it re-sends that
    epoch's report and ends: no epoch 3."""
    trial = _target_trial(0.2)
    checkpoints = {}
    sent = _epochs(_run(trial), 1, checkpoints)
    assert [e for e, _ in sent] == [1, 2] and max(checkpoints) == 2
    restored = _run(trial)
    start = restored.restore(checkpoints[2])
    again = _epochs(restored, start, checkpoints)
    assert [e for e, _ in again] == [None], [e for e, _ in again]  # the restored report, and nothing trained
    assert again[0][1] == sent[-1][1]


def test_a_target_reached_in_the_first_epoch_is_interpolated_from_the_untrained_model():
    """val_loss ≤ 0.5: the untrained model has 0.693, epoch 1 ends at 0.276, so the target lies 46 % of the way
    into epoch 1, not at its end (which made every trial that reaches it in epoch 1 tie on epochs_to_target 1.0)."""
    sent = _epochs(_run(_target_trial(0.5)), 1, {})
    (epoch, first), = sent
    assert epoch == 1
    assert 0.3 < first["epochs_to_target"] < 0.6, first["epochs_to_target"]
    assert first["time_to_target_s"] < first["train_seconds"]
    assert first["samples_to_target"] == pytest.approx(first["epochs_to_target"] * 96)
    # a target the untrained model already meets: reached at 0, and the trial still reports its epoch
    (_, at_start), = _epochs(_run(_target_trial(5.0)), 1, {})
    assert (at_start["epoch"], at_start["time_to_target_s"], at_start["epochs_to_target"]) == (1, 0.0, 0.0)


def test_a_restore_past_which_epochs_trained_again_keeps_the_clock_going_forward():
    """train.checkpoint_every 2: epoch 3 reported (clock T3), then a restart goes back to the checkpoint of epoch 2
    (T2 < T3) and trains epoch 3 again. Its first run is time the restart lost: the clock goes on from T3, so it
    never runs backwards and the lost seconds stay counted. A clock older than the checkpoint changes nothing."""
    run = _run(_target_trial(0.0, stop=False, epochs=4))
    state = {}
    _epochs(run, 1, state)
    restored = _run(run.trial)
    assert restored.restore(state[2], (3, 123.0)) == 3
    assert restored.train_seconds == 123.0
    older = _run(run.trial)
    older.restore(state[2], (1, 0.5))
    assert older.train_seconds == state[2]["train_seconds"]


def test_a_restart_before_the_first_checkpoint_keeps_the_seconds_already_trained():
    """train.checkpoint_every 50 (large_batch.yaml): a group lost at epoch 3 left no checkpoint, only its clock. The
    trial starts over from epoch 1, but on the clock it had reached: it got a fresh time budget, and its
    time_to_target_s left the lost seconds out. A target reached in the first epoch again is interpolated from there."""
    fresh = _run(_target_trial(0.5, stop=False, epochs=3))
    assert fresh.restore(None, (3, 42.0)) == 1 and fresh.train_seconds == 42.0
    (epoch, first), *_ = _epochs(fresh, 1, {})
    assert epoch == 1 and first["train_seconds"] > 42.0
    assert 42.0 < first["time_to_target_s"] < first["train_seconds"]
    assert _run(_target_trial(0.5)).restore(None) == 1  # no clock either: a fresh start


def test_a_clock_write_never_holds_the_epoch_and_a_storage_error_is_the_stores(tmp_path):
    """Rank 0 writes the clock in a thread of its own: a store that blocks (a FIFO where the file's temporary copy
    goes: open() waits for a reader) holds the thread, not the epoch; a store that refuses (that FIFO, which fsync
    refuses with EINVAL; a folder where the file goes) is a failure the next epoch's report reads (worker/entry's
    sender ends the trial as `infra` there)."""
    import os
    import threading

    from raysweep.layout import CLOCK_FILE, read_clock
    from raysweep.worker.clock import ClockWriter

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    fifo = blocked / f".{CLOCK_FILE}.{os.getpid()}.tmp"
    os.mkfifo(fifo)
    clock = ClockWriter(str(blocked))
    caller = threading.Thread(target=clock.write, args=(1, 1.5))
    caller.start()
    caller.join(timeout=10)
    assert not caller.is_alive(), "write() waited for the store"
    assert not clock.flush(0.5) and clock.failure is None  # the thread waits in the FIFO's open()
    with open(fifo, "rb") as reader:  # a reader: the write goes through, and fsync refuses a FIFO
        assert clock.flush(10)
        assert reader.read() == b'{"epoch": 1, "train_seconds": 1.5}'
    assert clock.failure is not None and "OSError" in clock.failure, clock.failure
    clock.close()

    run_dir = tmp_path / "trial-x"
    clock = ClockWriter(str(run_dir))
    clock.write(2, 3.0)
    assert clock.flush(10) and read_clock(str(run_dir)) == (2, 3.0) and clock.failure is None
    (run_dir / CLOCK_FILE).unlink()
    (run_dir / CLOCK_FILE).mkdir()  # the store refuses the next write
    clock.write(3, 4.5)
    assert clock.flush(10)
    assert clock.failure is not None and "IsADirectoryError" in clock.failure
    clock.close()


def test_the_sweeps_folder_names_live_in_layout_alone():
    """No module but layout.py spells a sweep's folder or file names (train/trial-<id>, checkpoint_<epoch>,
    state.pt, clock.json, slot-<n>, probe.json): resume.py reads a trial's checkpoints without
    importing the Ray entry point."""
    import ast
    from pathlib import Path

    names = {"trial-", "checkpoint_", "state.pt", "clock.json", "slot-", "probe.json"}
    root = Path(__file__).resolve().parents[1] / "raysweep"
    found = []
    for path in root.rglob("*.py"):
        if path.name == "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names | {
                    f"{n}{{" for n in names}:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.JoinedStr):
                for part in node.values:
                    if isinstance(part, ast.Constant) and any(part.value.startswith(n) for n in names):
                        found.append(f"{path.relative_to(root)}:{node.lineno} {part.value!r}")
    assert not found, found
    resume = ast.parse((root / "resume.py").read_text())
    imported = {n.module for n in ast.walk(resume) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and m.startswith("raysweep.worker")}, imported


def test_a_runs_ending_is_written_and_read_back_through_one_encoding_and_a_reopen_clears_all_of_it(tmp_path):
    """Every outcome a trial's run can end with, written by tracking.end_run from metrics.run_ending on a real store
    (SQLite), reads back as itself (metrics.outcome_of_run); a sweep ended with its runs still running marks them
    by the same encoding (interrupted, or failed for the infrastructure); reopen (--resume) leaves none of its tags.
    end_sweep and the resume wrote these tags by hand before, and reopen missed failure and the pruned marks."""
    from mlflow.tracking import MlflowClient

    from raysweep.metrics import ENDING_TAGS, FAILED, FINISHED, INTERRUPTED, PRUNED, outcome_of_run, run_ending
    from raysweep.tracking.runs import end_run, end_sweep, reopen

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("t")
    endings = {FINISHED: run_ending(FINISHED), PRUNED: run_ending(PRUNED, 2),
               INTERRUPTED: run_ending(INTERRUPTED, error="Ctrl-C"),
               FAILED: run_ending(FAILED, failure="diverged", error="diverged: at epoch 2")}
    for outcome, ending in endings.items():
        run_id = client.create_run(experiment).info.run_id
        end_run(client, run_id, ending)
        run = client.get_run(run_id)
        assert outcome_of_run(run.info.status, run.data.tags) == outcome
        reopen(client, run_id)
        run = client.get_run(run_id)
        assert run.info.status == "RUNNING" and not set(run.data.tags) & set(ENDING_TAGS), run.data.tags
    for status, child_outcome, kind in (("KILLED", INTERRUPTED, None), ("FAILED", FAILED, "infra")):
        parent = client.create_run(experiment).info.run_id
        child = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
        end_sweep(str(client.tracking_uri), parent, status, error="the driver was lost")
        run = client.get_run(child)
        assert outcome_of_run(run.info.status, run.data.tags) == child_outcome
        assert run.data.tags.get("failure") == kind and run.data.tags["error"] == "the driver was lost"
        assert client.get_run(parent).info.status == status
    # a sweep that ran to its end: the parent FINISHED with none of the ending tags (the refactor to one encoding
    # ended it KILLED + interrupted: every finished sweep read as interrupted), its finished children untouched
    parent = client.create_run(experiment).info.run_id
    done = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    end_run(client, done, run_ending(FINISHED))
    end_sweep(str(client.tracking_uri), parent, "FINISHED")
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and not set(run.data.tags) & set(ENDING_TAGS), run.data.tags
    assert client.get_run(done).info.status == "FINISHED"
