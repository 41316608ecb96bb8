"""The docs' real output and pictures: runs the quickstart exactly as docs/quickstart.md says (in a fresh folder,
its own local Ray), and writes what the pages show:

- docs/assets/quickstart_output.txt  the sweep's whole console output (stdout and stderr, in order)
- docs/assets/quickstart_files.txt   every file and folder the sweep wrote, with sizes
- docs/assets/quickstart_*.png       the report's plots (raysweep/report/plots.py), as the sweep wrote them

    python docs/make_assets.py          # 58 s on a 2-core x86 VM (2026-11-26)

The folder the sweep ran in is written as `.` in the text files, so they read as a run in the repository would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "docs" / "assets"
COMMAND = [sys.executable, "-m", "raysweep", "tune", "search_spaces/quickstart.yaml"]
PLOTS = ("metric_curves.png", "noise_scale.png")  # the ones the pages show


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
