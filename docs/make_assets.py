"""The docs' real output and pictures: runs the quickstart exactly as docs/quickstart.md says (in a fresh folder,
its own local Ray), and writes what the pages show:

- docs/assets/quickstart_output.txt  the sweep's whole console output (stdout and stderr, in order)
- docs/assets/quickstart_files.txt   every file and folder the sweep wrote, with sizes
- docs/assets/quickstart_*.png       the report's plots (raysweep/report/plots.py), as the sweep wrote them
- docs/assets/review_*.png           screenshots at 1280 px wide: the MLflow UI on the sweep's store (the link the
                                     sweep printed: its trials; the best trial's charts; the compare view of its
                                     trials) and the sweep's report.html, in the headless Chromium the tests drive
                                     (Debian's chromium and chromium-driver, selenium from `.[test]`)

    python docs/make_assets.py   # 5 min on a 2-core x86 VM with AVX2 only (the quickstart 208-217 s; 2026-11-29)

The folder the sweep ran in is written as `.` in the text files, so they read as a run in the repository would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "docs" / "assets"
COMMAND = [sys.executable, "-m", "raysweep", "tune", "search_spaces/quickstart.yaml"]
PLOTS = ("metric_curves.png", "noise_scale.png")  # the ones the pages show
WIDTH, HEIGHT = 1280, 900  # the screenshots' window: a laptop's width


class Browser:
    """Headless Chromium through Debian's chromedriver, started as tests/test_report.py starts it."""

    def __init__(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
        if not binary or not driver:
            raise SystemExit("the screenshots need chromium and chromium-driver (apt-get install chromium "
                             "chromium-driver) and selenium (pip install -e '.[test]')")
        options = webdriver.ChromeOptions()
        options.binary_location = binary
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={WIDTH},{HEIGHT}",
                    "--hide-scrollbars"):
            options.add_argument(arg)
        self.chrome = webdriver.Chrome(service=Service(driver), options=options)

    def shot(self, url: str, texts: tuple[str, ...], path: Path, search: str = "", timeout: float = 60) -> None:
        """Opens `url`, waits until the page shows every one of `texts`, closes MLflow's assistant panel, types
        `search` into the page's search box (if any), and saves the window once the charts have drawn."""
        from selenium.webdriver.common.by import By

        self.chrome.get(url)
        deadline = time.monotonic() + timeout
        while not all(t in (body := self.chrome.find_element(By.TAG_NAME, "body").text) for t in texts):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} never showed {texts}; it shows: {body[:800]}")
            time.sleep(0.5)
        for button in self.chrome.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
            if button.is_displayed():  # MLflow 3's assistant, open by default beside every page
                button.click()
        if search:
            self.chrome.find_element(By.CSS_SELECTOR, "input[placeholder^='Search']").send_keys(search)
        time.sleep(3)
        self.chrome.save_screenshot(str(path))

    def close(self) -> None:
        self.chrome.quit()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def screenshots(work: Path, out: str) -> list[Path]:
    """The review pages of the quickstart's sweep: `mlflow ui` on its store, then its report.html from disk."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{work / 'mlflow.db'}"
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("quickstart")
    runs = client.search_runs([experiment.experiment_id], order_by=["metrics.val_loss ASC"])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    best = children[0]
    port = _free_port()
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    server = subprocess.Popen([mlflow, "ui", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port)],
                              cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    browser = None
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("mlflow ui did not start") from None
                time.sleep(0.5)
        browser = Browser()
        base = f"http://127.0.0.1:{port}/#/experiments/{experiment.experiment_id}"
        link = next(line.split("then open ")[1].strip() for line in out.splitlines() if "then open " in line)
        link = link.replace("127.0.0.1:5000", f"127.0.0.1:{port}")
        trial_ids = [r.data.tags["trial_id"] for r in children]
        made = [ASSETS / name for name in ("review_mlflow_runs.png", "review_mlflow_trial_charts.png",
                                           "review_mlflow_compare.png", "review_report.png")]
        browser.shot(link, tuple(trial_ids), made[0])
        browser.shot(f"{base}/runs/{best.info.run_id}/model-metrics", ("Model metrics", "epoch_time_s"), made[1],
                     search="loss")
        ids = json.dumps([r.info.run_id for r in children])
        compare = (f"http://127.0.0.1:{port}/#/compare-runs?runs={urllib.parse.quote(ids)}"
                   f"&experiments={urllib.parse.quote(json.dumps([experiment.experiment_id]))}")
        browser.shot(compare, ("Parallel Coordinates Plot", trial_ids[0]), made[2])
        report = work / "raysweep_results" / "quickstart" / "report" / "report.html"
        browser.shot(report.as_uri(), ("The answer", "Trials"), made[3])
        return made
    finally:
        if browser is not None:
            browser.close()
        os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it started, nothing else
        server.wait(timeout=30)


def _tree(folder: Path) -> str:
    lines = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_dir():
            lines.append(f"{rel}/")
        else:
            lines.append(f"{rel}  ({path.stat().st_size:,} bytes)")
    return "\n".join(lines) + "\n"


def main() -> int:
    ASSETS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="raysweep-docs-") as tmp:
        work = Path(tmp)
        shutil.copytree(ROOT / "search_spaces", work / "search_spaces")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
        started = time.monotonic()
        done = subprocess.run(COMMAND, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=1800)
        wall = time.monotonic() - started
        out = done.stdout.replace(str(work.resolve()), ".").replace(str(work), ".")
        if done.returncode != 0:
            print(out[-5000:])
            print(f"the quickstart exited {done.returncode}", file=sys.stderr)
            return 1
        (ASSETS / "quickstart_output.txt").write_text(out)
        written = [p for p in work.iterdir() if p.name != "search_spaces"]
        (ASSETS / "quickstart_files.txt").write_text("".join(
            f"{p.name}/\n" + "".join(f"  {line}\n" for line in _tree(p).splitlines()) if p.is_dir()
            else f"{p.name}  ({p.stat().st_size:,} bytes)\n" for p in sorted(written)))
        report = work / "raysweep_results" / "quickstart" / "report"
        for name in PLOTS:
            if (report / name).is_file():
                shutil.copy(report / name, ASSETS / f"quickstart_{name}")
        print(f"quickstart: {wall:.0f} s; wrote {ASSETS}")
        shots = screenshots(work, done.stdout)
        print(f"screenshots: {', '.join(p.name for p in shots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
