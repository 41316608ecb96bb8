"""The users' scale: 50,000 real captcha PNGs at 160×60 for training and 5,000 for validation, named as users' sets
are (`TEXT_n.png` and bare `TEXT.png`, so listed in label order), and what raysweep does with them.

    python benchmarks/folder_scale.py [--train 50000] [--val 5000] [--folder DIR] [--keep]

1. Writes the folders (captcha 0.7's ImageCaptcha, seeded; reused when DIR already holds them).
2. Decodes them in this process with `data.load_data` on an empty cache, then again from the cache (what a second
   sweep's start costs), and prints each time and this process's peak RSS.
3. Runs the real command twice, `python -m raysweep train SPEC` (2 CPU workers, one epoch), first on an empty cache,
   then on the warm one, and prints for each: the driver process's peak RSS (psutil, every 50 ms), the seconds from
   the command to its `data:` line (the data decoded or read, and checked) and to the trial's first training step
   (the trial's MLflow run start, which the driver writes as Tune starts the trial, plus its `startup_s`: trial start
   → first step, metrics.STARTUP_PHASES). `--quick` (600 + 60 images, CI) runs the command once, on the empty cache.

Figures in benchmarks/RESULTS.md (folder_scale). Timings on the 2-core dev machines vary ±15 % between runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHARSET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SEED = {"train": 11, "val": 12}


def _names(split: str, count: int) -> list[tuple[int, str]]:
    """(index, file name): every other image bare `TEXT.png` where no earlier one took that name, else `TEXT_n.png`."""
    from raysweep.data.synthetic import folder_captcha_text

    taken, out = set(), []
    for i in range(count):
        text = folder_captcha_text(SEED[split], i, CHARSET, 4)
        bare = i % 2 == 0 and text not in taken
        taken.add(text)
        out.append((i, f"{text}.png" if bare else f"{text}_{i}.png"))
    return out


def _write_range(args) -> int:
    from raysweep.data.synthetic import write_captcha

    folder, split, items = args
    for i, name in items:
        write_captcha(Path(folder) / name, SEED[split], i, CHARSET, 4, 160, 60)
    return len(items)


def write_folders(root: Path, sizes: dict[str, int]) -> float:
    """Write the folders that are not there yet (a marker beside each says it is whole); returns seconds."""
    t0 = time.perf_counter()
    for split, count in sizes.items():
        folder = root / split
        marker = root / f".{split}.complete"  # beside the folder: a file in it would be one more to ignore
        if marker.is_file() and marker.read_text() == str(count):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        names = _names(split, count)
        chunks = [(str(folder), split, names[a:a + 500]) for a in range(0, count, 500)]
        done = 0
        with cf.ProcessPoolExecutor(os.cpu_count() or 1) as pool:
            for n in pool.map(_write_range, chunks):
                done += n
                print(f"\rwriting {split}: {done:,}/{count:,}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        marker.write_text(str(count))
    return time.perf_counter() - t0


def decode_twice(root: Path, cache: Path) -> list[tuple[str, float]]:
    """load_data on an empty cache, then from the cache: (label, seconds)."""
    from raysweep.config import DataConfig
    from raysweep.data import load_data

    shutil.rmtree(cache, ignore_errors=True)
    os.environ["RAYSWEEP_CACHE_DIR"] = str(cache)
    cfg = DataConfig(train_dir=root / "train", val_dir=root / "val")
    out = []
    for label in ("decode (empty cache)", "read (cache)"):
        t0 = time.perf_counter()
        data = load_data(cfg)
        out.append((label, time.perf_counter() - t0))
        print(f"{label}: {len(data.train):,} train + {len(data.val):,} val in {out[-1][1]:.1f} s", flush=True)
        for note in data.notes:
            print(f"  note: {note}")
        del data
    return out


def run_command(root: Path, cache: Path, work: Path) -> dict:
    """`python -m raysweep train SPEC` on the folders: the driver's peak RSS and the seconds to its `data:` line and
    to the trial's first training step."""
    import psutil

    spec = work / "folder_scale.yaml"
    spec.write_text(f"""name: folder_scale
storage_path: {work / 'results'}
data: {{train_dir: {root / 'train'}, val_dir: {root / 'val'}}}
scaling: {{num_workers: 2, use_gpu: false, cpus_per_worker: 1}}
train: {{epochs: 1, reference_batch_size: 256}}
search: {{per_gpu_batch_size: 256, base_lr: 1.0e-3, warmup_epochs: 0, weight_decay: 1.0e-4}}
mlflow: {{tracking_uri: sqlite:///{work / 'mlflow.db'}}}
""")
    env = {**os.environ, "RAYSWEEP_CACHE_DIR": str(cache)}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "raysweep", "train", str(spec)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, stamps, lines = [0], {}, []

    def watch():
        me = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                peak[0] = max(peak[0], me.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith("data:") and "data" not in stamps:
            stamps["data"] = time.time() - t0
    rc = proc.wait(timeout=3600)
    wall = time.time() - t0
    if rc != 0:
        print("\n".join(lines[-30:]))
        raise SystemExit(f"train exited {rc}")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("folder_scale")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
    child = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
    startup = client.get_metric_history(child.info.run_id, "startup_s")[0].value
    first_step = child.info.start_time / 1000 - t0 + startup
    return {"peak_rss_gb": peak[0] / 2**30, "to_data_s": stamps.get("data", float("nan")),
            "to_first_step_s": first_step, "startup_s": startup, "wall_s": wall,
            "samples_per_s": client.get_metric_history(child.info.run_id, "samples_per_s")[0].value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=50_000)
    parser.add_argument("--val", type=int, default=5_000)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "raysweep_folder_scale")
    parser.add_argument("--keep", action="store_true", help="keep the folders (the next run reuses them)")
    parser.add_argument("--quick", action="store_true", help="600 + 60 images in a folder of its own")
    args = parser.parse_args()
    if args.quick:
        args.train, args.val = 600, 60
        args.folder = Path(tempfile.mkdtemp(prefix="folder_scale_quick_"))
    import torch

    print(f"folder_scale on {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, python "
          f"{platform.python_version()}; {args.train:,} train + {args.val:,} val PNGs at 160×60", flush=True)
    root = args.folder
    written = write_folders(root, {"train": args.train, "val": args.val})
    on_disk = sum(p.stat().st_size for p in root.rglob("*.png")) / 2**20
    bare = sum(1 for p in (root / "train").glob("*.png") if "_" not in p.name)
    print(f"folders: {root} ({on_disk:,.0f} MiB, {bare:,} bare TEXT.png names in train), written in {written:.0f} s")
    work = Path(tempfile.mkdtemp(prefix="folder_scale_"))
    cache = work / "cache"
    decoded = decode_twice(root, cache)
    print(f"this process's peak RSS after both: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    size = sum(p.stat().st_size for p in cache.rglob("*.npz")) / 2**20
    print(f"cache: {size:,.0f} MiB under {cache}")
    shutil.rmtree(cache)
    rows = []
    # --quick (CI): the command once, on the empty cache (it decodes in the driver); a command on a warm cache is the
    # same code path, and its read of the cache is the `read (cache)` line above
    for label in ("train, empty cache",) + (() if args.quick else ("train, warm cache",)):
        r = run_command(root, cache, work)
        rows.append((label, r))
        print(f"{label}: driver peak RSS {r['peak_rss_gb']:.2f} GiB; command → data line {r['to_data_s']:.1f} s; "
              f"command → first trained step {r['to_first_step_s']:.1f} s (trial start-up {r['startup_s']:.1f} s); "
              f"whole command {r['wall_s']:.0f} s at {r['samples_per_s']:,.0f} samples/s", flush=True)
    ran = dict(rows)
    print(f"RESULT folder_scale_decode_s value={decoded[0][1]:.2f}")
    print(f"RESULT folder_scale_cached_read_s value={decoded[1][1]:.2f}")
    print(f"RESULT folder_scale_driver_peak_rss_gb value={max(r['peak_rss_gb'] for r in ran.values()):.2f}")
    print(f"RESULT folder_scale_first_step_cold_s value={ran['train, empty cache']['to_first_step_s']:.2f}")
    if "train, warm cache" in ran:
        print(f"RESULT folder_scale_first_step_warm_s value={ran['train, warm cache']['to_first_step_s']:.2f}")
    shutil.rmtree(work, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
