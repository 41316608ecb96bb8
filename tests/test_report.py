"""The sweep report: files and MLflow artifacts after `tune`, `report` from the store alone, and what a person
sees: `mlflow ui` on the sweep's store and report.html, driven in a real headless Chromium (Debian's chromium
and chromium-driver, installed by .ci/run; skipped where they are absent, except under .ci/run, which sets
RAYSWEEP_REQUIRE_BROWSER=1: there a missing browser fails). Screenshots are kept under the test's tmp dir
(screenshots/)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import tiny_spec, write_spec
from raysweep.cli import main

PLOTS = ("metric_curves.png", "metric_time.png", "lr_schedule.png", "batch_lr.png", "throughput_memory.png", "noise_scale.png")
SWEEP = dict(
    train={"epochs": 2, "reference_batch_size": 64},
    search={"per_gpu_batch_size": {"choice": [16, 32], "default": 16},
            "base_lr": {"loguniform": [1.0e-4, 3.0e-3], "default": 2.0e-3}, "warmup_epochs": 1,
            "weight_decay": 1.0e-4},
    tune={"num_samples": 3, "metric": "val_loss", "mode": "min", "seed": 0,
          "asha": {"max_t": 2, "grace_period": 1, "reduction_factor": 2}},
)


@pytest.fixture(scope="module")
def sweep(ray_cluster, tmp_path_factory):
    """One small sweep (3 trials, 2 epochs, 2 DDP workers each); its spec, output and store."""
    import io
    from contextlib import redirect_stdout

    tmp = tmp_path_factory.mktemp("report")
    spec = write_spec(tmp, tiny_spec(tmp, **SWEEP))
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["tune", str(spec), "--progress-every", "600"]) == 0
    return {"tmp": tmp, "spec": spec, "out": out.getvalue(), "uri": f"sqlite:///{tmp / 'mlflow.db'}"}


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _runs(uri):
    client = _client(uri)
    experiment = client.get_experiment_by_name("t")
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return experiment.experiment_id, parent, children


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_tune_writes_the_report_and_logs_it(sweep):
    out, tmp = sweep["out"], sweep["tmp"]
    folder = tmp / "results" / "t" / "report"
    assert {p.name for p in folder.iterdir()} >= {*PLOTS, "report.html", "trials"}
    experiment_id, parent, children = _runs(sweep["uri"])
    client = _client(sweep["uri"])
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {f"report/{p}" for p in (*PLOTS, "report.html")} <= logged
    for child in children:  # each trial's own curves on its child run
        assert f"{child.data.tags['trial_id']}.png" in {a.path for a in client.list_artifacts(child.info.run_id)}
    # the baseline: the spec's defaults ran first, tagged, and every other top trial is compared with it
    baseline = [c for c in children if c.data.tags.get("raysweep.baseline") == "true"]
    assert len(baseline) == 1 and baseline[0].data.params["per_gpu_batch_size"] == "16"
    base_id = baseline[0].data.tags["trial_id"]
    assert f"start  {base_id} (baseline: the spec's defaults)" in out
    assert f"Δ against the baseline {base_id} (the spec's defaults):" in out
    table = out.split("Δ against the baseline")[1].split("\n\n")[0].splitlines()[2:]
    others = [ln for ln in table if not ln.startswith(base_id)]
    assert others and all(re.search(r"\s[+-]\d", ln) for ln in others), table  # signed deltas
    import json

    summary = json.loads(client.download_artifacts(parent.info.run_id, "summary.json", str(tmp)) and
                         (tmp / "summary.json").read_text())
    assert {r["trial_id"] for r in summary} <= {c.data.tags["trial_id"] for c in children}
    assert all("delta_val_loss" in r and "delta_wall_s" in r for r in summary)
    # the printed link filters to this sweep's trials, by the ranking metric
    link = next(ln.split("then open ")[1] for ln in out.splitlines() if "then open " in ln)
    assert parent.info.run_id in link and "orderByKey=metrics.%60val_loss%60" in link
    assert "Columns → Metrics → val_loss" in out


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_report_rebuilds_everything_from_the_store_alone(sweep, capsys):
    import ray

    spec, tmp = sweep["spec"], sweep["tmp"]
    shutil.rmtree(tmp / "results" / "t" / "report")
    nodes_before = len(ray.nodes())
    assert main(["report", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "top trials by val_loss (min)" in out and "report.html" in out
    assert {p.name for p in (tmp / "results" / "t" / "report").iterdir()} >= {*PLOTS, "report.html"}
    assert len(ray.nodes()) == nodes_before  # no Ray started (the session cluster is the only one)
    # by experiment name, into a folder of its own
    assert main(["report", "--experiment", "t", "--tracking-uri", sweep["uri"], "--out", str(tmp / "elsewhere")]) == 0
    assert (tmp / "elsewhere" / "report.html").is_file()


@pytest.mark.parametrize("args, message", [
    (["--experiment", "nope"], "report: no experiment 'nope' in sqlite:///"),
    (["--experiment", "t", "--tracking-uri", "sqlite:////nonexistent/mlflow.db"], "report: no MLflow store at /nonexistent/mlflow.db"),
])
def test_report_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    store = tmp_path / "mlflow.db"
    if "nope" in args:
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{store}").create_experiment("other")
        args = [*args, "--tracking-uri", f"sqlite:///{store}"]
        capsys.readouterr()  # MLflow's own INFO lines from creating the store here, not raysweep's
    assert main(["report", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not Path("/nonexistent").exists()


# ---------------------------------------------------------------------------------------------
# --out: the report writes only into a folder of its own (no Ray: the report reads the store alone)


def _finished_sweep(tmp_path):
    """A spec and its sweep in a fresh store: the parent run as `tune` opens it, ended."""
    from raysweep import tracking
    from test_records import _open_sweep

    spec = write_spec(tmp_path, tiny_spec(tmp_path))
    uri, _, parent, _ = _open_sweep(tmp_path, spec)
    tracking.end_sweep(uri, parent, "FINISHED")
    return spec


def test_report_out_refuses_a_folder_holding_a_file_it_did_not_write_under_trials(tmp_path, capsys):
    """Issue 28: with only trials/keep.txt in the folder, the names at its top were all the report's, and the
    rebuild removed trials/ with the file in it."""
    spec = _finished_sweep(tmp_path)
    out = tmp_path / "out"
    (out / "trials").mkdir(parents=True)
    (out / "trials" / "keep.txt").write_text("a user's file")
    capsys.readouterr()  # MLflow's own INFO lines from creating the store
    assert main(["report", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"report folder {out}: it holds files raysweep did not write (trials/keep.txt); " \
        f"give a new or empty folder, e.g. --out {out / 'raysweep_report'}" in err[0], err
    assert (out / "trials" / "keep.txt").read_text() == "a user's file"
    assert sorted(p.name for p in out.rglob("*")) == ["keep.txt", "trials"]  # nothing written either


def _report_folder(folder: Path) -> Path:
    """A folder as `publish` leaves it: its marker, report.html, plots, trial PNGs; and the temporary file of a
    write a kill interrupted (storage.write_bytes)."""
    from raysweep.report import REPORT_MARKER

    for name in (REPORT_MARKER, "report.html", "metric_curves.png", "trials/t1.png", "trials/t2.png",
                 ".report.html.4242.tmp"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("raysweep's")
    return folder


@pytest.mark.parametrize("extra, named", [
    ("trials/drafts/keep.txt", "trials/drafts"),  # nested under trials/, which a rebuild removes whole
    ("notes/2024/keep.txt", "notes"),  # a folder of its own, beside the marker: named, not entered
    ("trials/t1.png.bak", "trials/t1.png.bak"),
    ("keep.txt", "keep.txt"),
])
def test_a_report_folder_is_claimed_only_while_it_holds_nothing_but_the_reports_files(tmp_path, extra, named):
    from raysweep.errors import UserError
    from raysweep.report import REPORT_MARKER, claim_folder

    folder = _report_folder(tmp_path / "report")
    claim_folder(folder)  # a report raysweep wrote: rebuilt in place
    claim_folder(tmp_path / "new")  # a new folder (and an empty one) too
    (folder / extra).parent.mkdir(parents=True, exist_ok=True)
    (folder / extra).write_text("a user's file")
    with pytest.raises(UserError, match=rf"^report folder {re.escape(str(folder))}: it holds files raysweep did not "
                                        rf"write \({re.escape(named)}\); give a new or empty folder"):
        claim_folder(folder)
    shutil.rmtree(folder / named) if (folder / named).is_dir() else (folder / named).unlink()
    claim_folder(folder)
    (folder / REPORT_MARKER).unlink()  # the report's names, but nothing says raysweep wrote them
    with pytest.raises(UserError, match=r"did not write \(\.report\.html\.4242\.tmp, metric_curves\.png, "
                                        r"report\.html, …\)"):
        claim_folder(folder)


# ---------------------------------------------------------------------------------------------
# In a real browser


# .ci/run sets it: CI must run these tests, so there a missing browser fails them instead of skipping them
REQUIRE_BROWSER = os.environ.get("RAYSWEEP_REQUIRE_BROWSER") == "1"


@pytest.fixture
def browser():
    """Headless Chromium through Debian's chromedriver; skipped where a piece is missing, failed under .ci/run."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    missing = [what for what, found in (("the selenium package (pip install -e '.[test]')", webdriver),
                                        ("chromium (apt-get install chromium)", binary),
                                        ("chromedriver (apt-get install chromium-driver)", driver)) if not found]
    if missing:
        message = f"no real browser: {', '.join(missing)} not found"
        if REQUIRE_BROWSER:
            pytest.fail(f"{message}; RAYSWEEP_REQUIRE_BROWSER=1 (set by .ci/run, which installs them) makes this a "
                        f"failure, not a skip", pytrace=False)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        options.add_argument(arg)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def _wait_text(browser, *texts, timeout=60) -> str:
    deadline = time.monotonic() + timeout
    body = ""
    while time.monotonic() < deadline:
        from selenium.webdriver.common.by import By

        body = browser.find_element(By.TAG_NAME, "body").text
        if all(t in body for t in texts):
            return body
        time.sleep(0.5)
    raise AssertionError(f"page never showed {texts}; it shows: {body[:1500]}")


@pytest.fixture
def mlflow_ui(sweep):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    proc = subprocess.Popen([mlflow, "ui", "--backend-store-uri", sweep["uri"], "--host", "127.0.0.1", "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError("mlflow ui did not start")
                time.sleep(0.5)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the job workers it started, nothing else
        proc.wait(timeout=30)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_mlflow_ui_in_chromium_shows_the_trials_the_curves_and_the_plots(sweep, browser, mlflow_ui):
    from selenium.webdriver.common.by import By

    shots = sweep["tmp"] / "screenshots"
    shots.mkdir(exist_ok=True)
    experiment_id, parent, children = _runs(sweep["uri"])
    trial_ids = [c.data.tags["trial_id"] for c in children]
    link = next(ln.split("then open ")[1] for ln in sweep["out"].splitlines() if "then open " in ln)
    link = link.replace("127.0.0.1:5000", f"127.0.0.1:{mlflow_ui}")
    base = f"http://127.0.0.1:{mlflow_ui}/#/experiments/{experiment_id}/runs"
    # 1. the printed link: this sweep's trials, each a row, sorted by val_loss
    browser.get(link)
    body = _wait_text(browser, *trial_ids, f"{len(children)} matching runs")
    browser.save_screenshot(str(shots / "1_runs_link.png"))
    assert "Sort: val_loss" in body
    # 2. a child is nested under the parent (its overview names the parent run)
    child = children[0]
    browser.get(f"{base}/{child.info.run_id}")
    _wait_text(browser, child.data.tags["trial_id"], parent.info.run_name)
    browser.save_screenshot(str(shots / "2_child_overview.png"))
    # 3. the child's metric charts
    browser.get(f"{base}/{child.info.run_id}/model-metrics")
    _wait_text(browser, "Model metrics", "clip_fraction", "epoch_time_s", "Step")  # charts, alphabetical
    assert browser.find_elements(By.CSS_SELECTOR, "svg, canvas")
    browser.save_screenshot(str(shots / "3_child_metrics.png"))
    # 4. the parent's artifacts: the report's plots listed, one shown
    browser.get(f"{base}/{parent.info.run_id}/artifacts/report/metric_curves.png")
    _wait_text(browser, "report", *PLOTS, "report.html", "spec.yaml")
    images = browser.find_elements(By.CSS_SELECTOR, "img")
    deadline = time.monotonic() + 30
    while not any(browser.execute_script("return arguments[0].naturalWidth", i) > 100 for i in images):
        assert time.monotonic() < deadline, "the plot never rendered"
        time.sleep(0.5)
        images = browser.find_elements(By.CSS_SELECTOR, "img")
    browser.save_screenshot(str(shots / "4_parent_artifacts.png"))


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_report_html_from_disk_in_chromium(sweep, browser):
    from selenium.webdriver.common.by import By

    shots = sweep["tmp"] / "screenshots"
    shots.mkdir(exist_ok=True)
    html = sweep["tmp"] / "results" / "t" / "report" / "report.html"
    if not html.is_file():  # the rebuild test removed and remade it; either way it is there
        assert main(["report", str(sweep["spec"])]) == 0
    _, parent, children = _runs(sweep["uri"])
    browser.get(html.as_uri())
    body = _wait_text(browser, "Trials", "Plots", "Spec", "Baseline (the spec's defaults)")
    rows = browser.find_elements(By.CSS_SELECTOR, "table#summary tr")
    assert len(rows) == 1 + len(children)  # header + every trial
    images = browser.find_elements(By.CSS_SELECTOR, "img")
    widths = [browser.execute_script("return arguments[0].naturalWidth", i) for i in images]
    assert len(images) == len(PLOTS) and all(w > 500 for w in widths), widths  # inlined, decoded
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "table#summary a")]
    assert {c.info.run_id for c in children} <= {h.rsplit("/", 1)[1] for h in links}
    assert "reference_batch_size" in body  # the resolved spec
    browser.set_window_size(1600, 4000)
    browser.save_screenshot(str(shots / "5_report_html.png"))
