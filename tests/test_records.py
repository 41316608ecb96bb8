"""What a failure leaves behind: no MLflow run left RUNNING (an exception, a dead driver), a `--resume` that checks
before it works, a report that writes only its own files. Real MLflow on SQLite in tmp_path; real Ray where a
sweep runs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from raysweep import drivers, storage, tracking
from raysweep.cli import main
from raysweep.config import load_config, spec_yaml

from conftest import tiny_spec, write_spec


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _all_runs(uri):
    client = _client(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _open_sweep(tmp_path, spec_path, **tags):
    """A sweep's parent run as `tune` opens it (with this process as its driver) and one RUNNING child."""
    config = load_config(spec_path)
    uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    experiment_path = storage.join(storage.resolve(config.storage_path), config.name)
    experiment_id, parent = tracking.open_sweep(
        uri, config.experiment_name, "sweep", {"raysweep.kind": "tune", "raysweep.storage": experiment_path},
        spec_yaml(config))
    child = _client(uri).create_run(experiment_id, run_name="trial", tags={"mlflow.parentRunId": parent}).info.run_id
    for key, value in tags.items():
        _client(uri).set_tag(parent, key, value)
    return uri, experiment_path, parent, child


# ---------------------------------------------------------------------------------------------
# No run left RUNNING


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_an_exception_inside_the_sweep_ends_the_parent_and_the_running_trial_failed_with_the_cause(
        ray_cluster, tmp_path, monkeypatch):
    from raysweep.callbacks import ConsoleEvents

    real = ConsoleEvents.on_trial_result

    def on_trial_result(self, iteration, trials, trial, result, **info):
        real(self, iteration, trials, trial, result, **info)
        if result.get("epoch") == 2:
            raise RuntimeError("injected: the console broke at epoch 2")

    monkeypatch.setattr(ConsoleEvents, "on_trial_result", on_trial_result)
    spec = write_spec(tmp_path, tiny_spec(tmp_path, train={"epochs": 4, "reference_batch_size": 64}))
    with pytest.raises(Exception, match="injected|Tune run failed"):
        main(["tune", str(spec)])
    runs = _all_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(runs) == 2 and not [r for r in runs if r.info.status == "RUNNING"]
    for run in runs:  # the parent and the trial that was running
        assert run.info.status == "FAILED", run.info.run_name
        assert "injected: the console broke at epoch 2" in run.data.tags["error"], run.data.tags


def test_mlflow_writes_leave_tunes_loop_at_once_land_in_order_and_only_then_tell_the_slots(tmp_path, monkeypatch):
    """Tune's loop never waits on the store: with every MLflow write held back, the callback's events return at
    once; released, the writes land in the order Tune saw them (the epochs held meanwhile in one write), and only a
    written epoch is announced to the slots (a checkpoint waits for it: slots.Broker.recorded_through). A store
    that blinks within mlflow.retry_s loses nothing (the epoch lands once); one that fails past it fails the next
    event."""
    import threading
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from raysweep.callbacks import MLflowEvents

    spec = write_spec(tmp_path, tiny_spec(tmp_path, mlflow={"retry_s": 3}))
    config = load_config(spec)
    uri = tracking.resolve_tracking_uri(config.mlflow.tracking_uri)
    experiment_id, parent = tracking.open_sweep(uri, config.experiment_name, "sweep", {}, spec_yaml(config))
    stored = []
    callback = MLflowEvents(tracking.TrialRuns(uri, experiment_id, parent), config.trials, 64, config.horizon,
                            config.mlflow.retry_s, lambda trial_id, epoch: stored.append((trial_id, epoch)))
    gate, real = threading.Event(), MlflowClient.log_batch

    def held(self, *args, **kwargs):
        assert gate.wait(60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", held)
    trial = SimpleNamespace(trial_id="t1", config=config.trials.default_knobs())

    def events():
        callback.on_trial_start(0, [], trial)
        for epoch in (1, 2, 2, 3):  # epoch 2 twice: a restarted group re-sends its checkpoint's epoch
            callback.on_trial_result(0, [], trial, {"epoch": epoch, "train_loss": 1.0 / epoch})

    tune_loop = threading.Thread(target=events)
    tune_loop.start()
    tune_loop.join(30)
    assert not tune_loop.is_alive() and stored == []  # every event returned; nothing is in the store yet
    gate.set()
    tracking.flush_writes(parent)
    run_id = callback.get_state()["runs"]["t1"]
    history = _client(uri).get_metric_history(run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    # the reports held meanwhile went in one write (one log_batch per run per turn of the writer), then announced
    assert stored == [("t1", 3)]
    assert callback.get_state()["logged"] == {"t1": 3}

    blinks = []

    def blinking(self, *args, **kwargs):  # the write reaches the store, but its answer is lost
        if len(blinks) < 2:
            blinks.append(real(self, *args, **kwargs))
            raise ConnectionError("the tracking server restarted")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", blinking)
    callback.on_trial_result(0, [], trial, {"epoch": 4, "train_loss": 0.25})
    tracking.flush_writes(parent)
    history = _client(uri).get_metric_history(run_id, "train_loss")
    assert [(m.step, m.value) for m in history][-1] == (4, 0.25) and len(history) == 4  # once, though sent twice
    # the retry read the store first, found the epoch there, and did not send it again
    assert stored[-1] == ("t1", 4) and len(blinks) == 1

    def down(self, *args, **kwargs):
        raise ConnectionError("the tracking server is down")

    monkeypatch.setattr(MlflowClient, "log_batch", down)
    callback.on_trial_result(0, [], trial, {"epoch": 5, "train_loss": 0.2})
    with pytest.raises(RuntimeError, match=r"did not answer for mlflow.retry_s \(3 s\): ConnectionError: the "
                                           r"tracking server is down"):
        tracking.flush_writes(parent)  # after mlflow.retry_s (3 s here) of retries
    with pytest.raises(RuntimeError, match="did not answer for mlflow.retry_s"):
        callback.on_trial_result(0, [], trial, {"epoch": 6, "train_loss": 0.1})
    assert stored[-1] == ("t1", 4)


def test_runs_whose_driver_is_gone_are_ended_by_the_next_command_on_the_store(tmp_path):
    spec = write_spec(tmp_path, tiny_spec(tmp_path))
    dead = _dead_pid()
    uri, _, lost_here, lost_child = _open_sweep(tmp_path, spec, **{"raysweep.driver.pid": str(dead)})
    _, _, alive_here, alive_child = _open_sweep(tmp_path, spec)  # this process: alive
    stale = time.time() - drivers.STALE_AFTER_S - 60
    _, _, lost_there, _ = _open_sweep(tmp_path, spec, **{"raysweep.driver.host": "elsewhere",
                                                        "raysweep.heartbeat": repr(stale)})
    _, _, beating_there, _ = _open_sweep(tmp_path, spec, **{"raysweep.driver.host": "elsewhere"})
    assert main(["report", str(spec), "--out", str(tmp_path / "report")]) == 0  # any command on the store
    client = _client(uri)
    for run_id in (lost_here, lost_child, lost_there):
        run = client.get_run(run_id)
        assert (run.info.status, run.data.tags.get("error")) == ("FAILED", drivers.DRIVER_LOST), run_id
    for run_id in (alive_here, alive_child, beating_there):
        assert client.get_run(run_id).info.status == "RUNNING"  # a live driver's runs are left alone


def test_the_heartbeat_refreshes_while_the_sweep_runs(tmp_path):
    uri, _, parent, _ = _open_sweep(tmp_path, write_spec(tmp_path, tiny_spec(tmp_path)))
    before = float(_client(uri).get_run(parent).data.tags["raysweep.heartbeat"])
    with tracking.Heartbeat(uri, parent, every_s=0.2):
        time.sleep(1.0)
    assert float(_client(uri).get_run(parent).data.tags["raysweep.heartbeat"]) > before + 0.5


_OPENER = """
import sys, time
from pathlib import Path
from mlflow.tracking import MlflowClient
from raysweep import tracking
uri, who, go = sys.argv[1], sys.argv[2], float(sys.argv[3])
while time.time() < go:  # imported: start together
    time.sleep(0.001)
if who == "mlflow":  # another program on the store, as `mlflow ui` or a notebook: MLflow creates it in place
    print(len(MlflowClient(uri).search_experiments()))
else:  # a sweep's driver
    print(tracking.open_sweep(uri, "e", who, {"raysweep.kind": "tune"}, "name: " + who + chr(10))[1])
"""


def test_drivers_and_another_program_opening_a_fresh_store_together_all_get_it(tmp_path):
    # Two sweeps started from one folder share its ./mlflow.db, and `mlflow ui` may be opened on it as they start.
    # MLflow creates a SQLite store in place, with migrations that two processes run over each other ("duplicate
    # column name", "table experiments already exists", or alembic's CircularDependencyError: all seen here), so
    # every opener but one failed. Three rounds, each on a fresh store: today's code fails the first.
    for round_ in range(3):
        uri = f"sqlite:///{tmp_path / f'round{round_}' / 'mlflow.db'}"
        (tmp_path / f"round{round_}").mkdir()
        go = time.time() + 8  # after every process has imported MLflow (2-3 s each, on 2 cores)
        procs = {who: subprocess.Popen([sys.executable, "-c", _OPENER, uri, who, repr(go)], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
                 for who in ("a", "b", "mlflow")}
        outs = {who: proc.communicate(timeout=120)[0] for who, proc in procs.items()}
        assert {who: proc.returncode for who, proc in procs.items()} == {"a": 0, "b": 0, "mlflow": 0}, \
            {who: out[-1500:] for who, out in outs.items()}
        client = _client(uri)
        parents = client.search_runs([client.get_experiment_by_name("e").experiment_id])
        assert sorted(r.info.run_name for r in parents) == ["a", "b"]
        assert sorted(r.info.run_id for r in parents) == sorted(outs[w].split()[-1] for w in ("a", "b"))
        assert not list((tmp_path / f"round{round_}").glob(".mlflow.db*"))  # no scratch file left beside it


def test_threads_of_one_process_creating_stores_together_all_get_theirs(tmp_path):
    import threading

    from raysweep.tracking import store

    # alembic keeps the migration under way in module globals: two creations in two threads of one process, even of
    # two stores, ran each other's steps on the wrong file (the CI's "no such table: jobs": a test's thread polling
    # its store while the sweep it ran in-process created its own). Three threads, three new stores, three rounds.
    def open_(db, go, failed):
        go.wait()
        try:
            store.mlflow_client(f"sqlite:///{db}").search_experiments()
        except Exception as e:  # the test reports every thread's failure
            failed.append(f"{db.name}: {e!r}"[:300])

    for round_ in range(3):
        go, failed = threading.Barrier(3), []
        threads = [threading.Thread(target=open_, args=(tmp_path / f"{name}{round_}.db", go, failed))
                   for name in "abc"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not failed and not any(t.is_alive() for t in threads), failed
        assert all(store._whole(tmp_path / f"{name}{round_}.db") for name in "abc")


def test_a_store_another_program_is_creating_is_waited_for_and_one_left_empty_is_handed_to_mlflow(tmp_path,
                                                                                                 monkeypatch):
    from raysweep.tracking import store

    # MLflow creating the store in place in another process (as `mlflow ui` does), caught half made: waited for
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    other = subprocess.Popen([sys.executable, "-c", _OPENER, uri, "mlflow", "0"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not db.exists() and time.monotonic() < deadline and other.poll() is None:
        time.sleep(0.005)
    assert db.exists() and not store._whole(db), "the other program's store was not caught half made"
    experiment_id, _ = tracking.open_sweep(uri, "e", "a", {"raysweep.kind": "tune"}, "name: a\n")
    assert other.wait(timeout=60) == 0, other.stdout.read()
    assert store._whole(db) and experiment_id != "0"
    # an empty file (`touch mlflow.db`) stops changing: after STALLED_S it is MLflow's to open, which creates the store
    monkeypatch.setattr(store, "STALLED_S", 0.5)
    empty = tmp_path / "empty" / "mlflow.db"
    empty.parent.mkdir()
    empty.touch()
    started = time.monotonic()
    assert [e.name for e in store.mlflow_client(f"sqlite:///{empty}").search_experiments()] == ["Default"]
    assert 0.5 < time.monotonic() - started < 60


# ---------------------------------------------------------------------------------------------
# How a trial's run ends, and how the store reads it back: one pair (metrics.run_ending, metrics.outcome_of_run)


@pytest.mark.parametrize("outcome, extra, status, tags", [
    ("finished", {}, "FINISHED", {}),
    ("pruned", {"epoch": 4}, "KILLED", {"stopped_by": "asha", "stopped_at_epoch": "4"}),
    ("failed", {"failure": "oom", "error": "CUDA out of memory"}, "FAILED",
     {"error": "CUDA out of memory", "failure": "oom"}),
])
def test_a_trials_outcome_is_written_as_a_run_status_and_tags_and_read_back(outcome, extra, status, tags):
    from raysweep.metrics import outcome_of_run, run_ending

    ending = run_ending(outcome, **extra)
    assert (ending.status, ending.tags) == (status, tags)
    assert outcome_of_run(*ending) == outcome


def test_runs_no_trial_ended_read_as_running_or_interrupted_and_an_ending_needs_what_it_writes():
    from raysweep.metrics import ERROR_TAG_CHARS, outcome_counts, outcome_of_run, run_ending

    assert outcome_of_run("RUNNING", {}) == "running"
    assert outcome_of_run("KILLED", {"interrupted": "true"}) == "interrupted"  # tracking's end_sweep: Ctrl-C
    assert outcome_of_run("SCHEDULED", {}) == "interrupted"
    assert len(run_ending("failed", failure="error", error="x" * 9000).tags["error"]) == ERROR_TAG_CHARS
    with pytest.raises(ValueError, match="give finished, pruned, or failed with its failure kind and error line"):
        run_ending("failed", failure="oom")
    with pytest.raises(ValueError, match="no run ending for outcome 'running'"):
        run_ending("running")

    class Trial:
        def __init__(self, status):
            self.status = status

    counts = outcome_counts([Trial(s) for s in ("finished", "pruned", "finished", "interrupted")])
    assert counts == {"finished": 2, "pruned": 1, "failed": 0, "interrupted": 1, "running": 0}


# ---------------------------------------------------------------------------------------------
# --resume checks before it works


@pytest.fixture
def no_ray_no_data(monkeypatch):
    """--resume's checks come first: reaching Ray or the data fails the test."""
    import raysweep.cluster
    import raysweep.data

    def unreachable(*args, **kwargs):
        raise AssertionError("--resume started Ray or loaded data before its checks")

    monkeypatch.setattr(raysweep.cluster, "connect", unreachable)
    monkeypatch.setattr(raysweep.data, "load_data", unreachable)


def test_resume_of_a_folder_without_a_tune_experiment_is_one_line_before_ray(tmp_path, capsys, no_ray_no_data):
    spec = write_spec(tmp_path, tiny_spec(tmp_path))
    storage.write_text(str(tmp_path / "results" / "t" / "probe.json"), "{}")  # what `probe` leaves there
    assert main(["tune", str(spec), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no Tune experiment to resume (only probe.json" in err[0], err


def test_resume_refuses_a_changed_spec_naming_the_keys_and_a_sweep_whose_driver_still_runs(tmp_path, capsys,
                                                                                         no_ray_no_data):
    from raysweep.resume import check_resume

    spec = write_spec(tmp_path, tiny_spec(tmp_path))
    uri, experiment_path, parent, _ = _open_sweep(tmp_path, spec)
    storage.write_bytes(storage.join(experiment_path, "tuner.pkl"), b"")  # what Tuner.can_restore looks for
    capsys.readouterr()
    assert main(["tune", str(spec), "--resume", "--set", "train.epochs=8", "--set", "tune.num_samples=4",
                 "--set", "train.max_failures=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the spec differs from the sweep's own (spec.yaml of MLflow run {parent})" in err[0]
    assert "train.epochs: 3 → 8; tune.num_samples: 1 → 4." in err[0] and "max_failures" not in err[0], err
    # the same spec, but the sweep's driver (this process) still runs it
    assert main(["tune", str(spec), "--resume"]) == 2
    assert "this sweep's driver still runs" in capsys.readouterr().err
    assert _client(uri).get_run(parent).info.status == "RUNNING"  # a refused resume touched nothing
    _client(uri).set_tag(parent, "raysweep.driver.pid", str(_dead_pid()))
    config = load_config(spec, ["train.max_failures=3"])  # a retry budget may change
    assert check_resume(config, uri, experiment_path, "t") == parent


# ---------------------------------------------------------------------------------------------
# The report writes only its own files


def test_report_refuses_a_folder_of_other_files_and_writes_only_its_own(tmp_path, capsys):
    spec = write_spec(tmp_path, tiny_spec(tmp_path))
    uri, _, parent, child = _open_sweep(tmp_path, spec)
    tracking.end_sweep(uri, parent, "FINISHED")
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / "mlflow.db").write_bytes(b"not the report's")
    (project / "trials").mkdir()
    (project / "trials" / "mine.txt").write_text("a user's file")
    capsys.readouterr()  # MLflow's own INFO lines from creating the store here
    assert main(["report", str(spec), "--out", str(project)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (
        f"report folder {project}: it holds files raysweep did not write (.git, mlflow.db" in err[0]
    )
    assert (project / "trials" / "mine.txt").read_text() == "a user's file"  # nothing deleted

    out = tmp_path / "report"
    assert main(["report", str(spec), "--out", str(out)]) == 0
    assert main(["report", str(spec), "--out", str(out)]) == 0  # its own folder: rebuilt
    logged = {a.path for a in _client(uri).list_artifacts(parent, "report")}
    assert "report/report.html" in logged and "report/.raysweep-report" not in logged, logged
    (out / "notes.txt").write_text("written beside the report later")
    capsys.readouterr()
    assert main(["report", str(spec), "--out", str(out)]) == 2  # no longer the report's alone: refused
    assert "it holds files raysweep did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").is_file()
