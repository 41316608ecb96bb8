"""A package index of our own, for machines that reach no other (tests/hosts.py's hosts).

`wheelhouse(folder, requirements)` downloads, through this machine's pip and its index, every wheel the requirements
need (for this machine's Python and platform); `serve(folder, host)` answers for them as a PEP 503 "simple" index over
HTTP (`http://host:port/simple/`, one page per project, each link with its sha256), the way a mirror or PyPI does.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import re
import subprocess
import sys
import threading
from pathlib import Path


def wheelhouse(folder: Path, requirements: list[str], timeout: float = 600) -> list[Path]:
    """Every wheel `requirements` resolve to, in `folder` (pip's download cache makes a second call quick)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(folder),
                           *requirements], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(requirements)}: {done.stderr[-2000:]}")
    return sorted(folder.glob("*.whl"))


def _project(wheel: str) -> str:
    return re.sub(r"[-_.]+", "-", wheel.split("-")[0]).lower()  # PEP 503's normalized name


class Index:
    """A simple index of `folder`'s wheels on `host`, in a thread; `url` ends in /simple/."""

    def __init__(self, folder: Path, host: str, exclude: tuple[str, ...] = ()):
        root = folder.parent / f"{folder.name}-index"
        pages: dict[str, list[str]] = {}
        for wheel in sorted(folder.glob("*.whl")):
            name = _project(wheel.name)
            if name in exclude:
                continue
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            pages.setdefault(name, []).append(f'<a href="/files/{wheel.name}#sha256={digest}">{wheel.name}</a><br>')
        for name, links in pages.items():
            (root / "simple" / name).mkdir(parents=True, exist_ok=True)
            page = "<html><body>\n" + "\n".join(links) + "\n</body></html>\n"
            (root / "simple" / name / "index.html").write_text(page)
        (root / "simple" / "index.html").write_text(
            "".join(f'<a href="/simple/{name}/">{name}</a><br>\n' for name in sorted(pages)))
        files = root / "files"
        if not files.exists():
            files.symlink_to(folder.resolve())
        handler = functools.partial(_Quiet, directory=str(root))
        self.server = http.server.ThreadingHTTPServer((host, 0), handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/simple/"
        self.projects = sorted(pages)
        self.thread = threading.Thread(target=self.server.serve_forever, name="wheel-index", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # noqa: D102 - pip's hundreds of requests stay out of the test's output
        pass
