"""What the data rooms hand on: decoded arrays (`CaptchaArrays`), a sweep's data (`CaptchaData`: the arrays, where
they came from, what was converted on the way) and what `check` describes (`FolderFacts`, `DataFacts`); the label
encoding and the cache folder they share."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# progress(label, done, total): called as work advances (the driver prints it: console.progress_printer); None: quiet
ProgressFn = Callable[[str, int, int], None]


def quiet(label: str, done: int, total: int) -> None:
    pass


@dataclass(frozen=True)
class CaptchaArrays:
    """Decoded images, (N, H, W) uint8 grayscale or (N, H, W, 3) RGB (data.channels), and labels (N, length) uint8
    indices into the charset."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class FolderFacts:
    """What one folder held and what reading it changed (data.folder.read_folder): `check` shows it, and every
    change is one line of `CaptchaData.notes`."""

    key: str  # the spec key that named it: data.train_dir or data.val_dir
    folder: str
    images: int
    formats: dict[str, int]  # PIL's format name → images (PNG, JPEG, ...)
    modes: dict[str, int]  # PIL's mode as stored → images (L, RGB, RGBA, P, I;16, ...)
    sizes: dict[str, int]  # "W×H" as stored → images
    resized: int  # images not at data.width × data.height, resized to it
    folded: int = 0  # labels whose letters were read in data.charset's case
    fold: str = ""  # "uppercase" or "lowercase": the case they were read as
    ignored: tuple[str, ...] = ()  # files in the folder that are not images (by suffix), by name
    duplicates: int = 0  # images whose pixels another image of the folder already has
    from_cache: bool = False  # decoded by an earlier run (data.folder's cache): nothing decoded this time


@dataclass(frozen=True)
class DataFacts:
    """What a sweep's data holds beyond its arrays: each folder's facts and the leakage between them."""

    train: FolderFacts | None  # None: the synthetic set
    val: FolderFacts | None  # None: synthetic, or held out of data.train_dir (val_fraction)
    val_in_train: int = 0  # validation images whose pixels are also in the training set
    leak_example: tuple[str, str] | None = None  # (validation file, training file) with the same pixels


@dataclass(frozen=True)
class CaptchaData:
    train: CaptchaArrays
    val: CaptchaArrays
    source: str  # where the images came from, for logs and MLflow
    # what reading the folders changed or found (a conversion, a resize, leakage), one line each: stated once on
    # the console and logged with the sweep (describe.mlflow_params)
    notes: tuple[str, ...] = ()
    facts: DataFacts | None = field(default=None, compare=False)

    def for_workers(self) -> CaptchaData:
        """The arrays alone: what goes into the object store for the ranks."""
        return CaptchaData(self.train, self.val, self.source)


@functools.lru_cache(maxsize=8)
def charset_index(charset: str) -> dict[str, int]:
    """Character → its label index (built once per charset: a folder's 50,000 labels use one)."""
    return {c: i for i, c in enumerate(charset)}


def encode_label(text: str, charset: str) -> np.ndarray:
    index = charset_index(charset)
    return np.array([index[c] for c in text], dtype=np.uint8)


def cache_dir() -> Path:
    """`$RAYSWEEP_CACHE_DIR`, else `$XDG_CACHE_HOME/raysweep`, else `~/.cache/raysweep`."""
    if os.environ.get("RAYSWEEP_CACHE_DIR"):
        return Path(os.environ["RAYSWEEP_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raysweep"


def save_npz(path: Path, **arrays) -> bool:
    """`np.savez` written whole or not at all: a killed run never leaves a half-written cache behind. A cache that
    cannot be written (a read-only home, a full disk) costs the next run a decode, never this one: logged, False."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
        return True
    except OSError as e:
        log.warning("could not write the cache %s (%s); the next run decodes again (RAYSWEEP_CACHE_DIR moves the "
                    "cache)", path, e.strerror or e)
        return False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
