"""Captcha images → decoded uint8 arrays, once per sweep. The training loop never opens a PNG.

A data folder holds `TEXT_anything.png` files: the label is the text before the first `_`.
With no folder configured, a seeded synthetic set is rendered with `captcha.image.ImageCaptcha`
and cached under the user cache directory, keyed by every parameter that changes its pixels.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import multiprocessing
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raysweep.errors import UserError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}
SPLIT_SEED = 0  # hold-out split of a single folder: fixed, so every trial and sweep sees the same split
GENERATOR_VERSION = 1  # bump when the rendering below changes, so old caches are not reused


@dataclass(frozen=True)
class CaptchaArrays:
    """Decoded images (N, H, W) uint8 grayscale and labels (N, length) uint8 indices into the charset."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


# progress(label, done, total): called as work advances (the driver prints it: console.progress_printer); None: quiet
ProgressFn = Callable[[str, int, int], None]


def _quiet(label: str, done: int, total: int) -> None:
    pass


@dataclass(frozen=True)
class CaptchaData:
    train: CaptchaArrays
    val: CaptchaArrays
    source: str  # where the images came from, for logs and MLflow


def load_data(cfg, progress: ProgressFn | None = None) -> CaptchaData:
    """The train/val arrays for a `DataConfig`: from folders, else the (cached) synthetic set."""
    if cfg.train_dir is None:
        return synthetic_data(cfg, progress=progress)
    train = read_folder(cfg.train_dir, cfg.charset, cfg.length, cfg.width, cfg.height, "data.train_dir", progress)
    if cfg.val_dir is not None:
        val = read_folder(cfg.val_dir, cfg.charset, cfg.length, cfg.width, cfg.height, "data.val_dir", progress)
        return CaptchaData(train, val, source=f"{cfg.train_dir} + {cfg.val_dir}")
    order = np.random.default_rng(SPLIT_SEED).permutation(len(train))
    n_val = max(1, round(len(train) * cfg.val_fraction))
    if n_val >= len(train):
        raise UserError(f"data.train_dir: {len(train)} images are too few to hold out val_fraction {cfg.val_fraction}")
    val_idx, train_idx = np.sort(order[:n_val]), order[n_val:]
    split = CaptchaData(
        CaptchaArrays(train.images[train_idx], train.labels[train_idx]),
        CaptchaArrays(train.images[val_idx], train.labels[val_idx]),
        source=f"{cfg.train_dir} (val_fraction {cfg.val_fraction})",
    )
    return split


def encode_label(text: str, charset: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(charset)}
    return np.array([index[c] for c in text], dtype=np.uint8)


def read_folder(
    folder: Path, charset: str, length: int, width: int, height: int, key: str = "data.train_dir",
    progress: ProgressFn | None = None,
) -> CaptchaArrays:
    """Decode every image of a folder; bad labels and unreadable files are one error naming up to 5."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UserError(f"{key}: no .png/.jpg images in {str(folder)!r} (expected files named TEXT_anything.png)")
    allowed = set(charset)
    bad = []
    for p in files:
        text = p.name.split("_", 1)[0] if "_" in p.name else p.stem
        if len(text) != length:
            bad.append(f"{p.name} (label {text!r} has {len(text)} characters, not {length})")
        elif not set(text) <= allowed:
            outside = "".join(sorted(set(text) - allowed))
            bad.append(f"{p.name} (label {text!r} has {outside!r}, not in data.charset)")
    if bad:
        raise UserError(
            f"{key}: {len(bad)} of {len(files)} files in {str(folder)!r} have bad labels: {'; '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''} (name files TEXT_anything.png, or change data.charset / data.length)"
        )
    images = np.empty((len(files), height, width), dtype=np.uint8)
    labels = np.stack([encode_label(p.name.split("_", 1)[0] if "_" in p.name else p.stem, charset) for p in files])
    unreadable: list[str] = []
    resized = 0

    def decode(i: int) -> bool:
        from PIL import Image

        try:
            with Image.open(files[i]) as im:
                im = im.convert("L")
                if im.size != (width, height):
                    im = im.resize((width, height), Image.Resampling.BILINEAR)
                    images[i] = np.asarray(im)
                    return True
                images[i] = np.asarray(im)
                return False
        except Exception as e:  # any decode failure is the file's fault; report it by name
            unreadable.append(f"{files[i].name} ({type(e).__name__})")
            return False

    report, label = progress or _quiet, f"decoding {folder.name}"
    report(label, 0, len(files))
    with cf.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # PIL decodes without the GIL
        for done, was_resized in enumerate(pool.map(decode, range(len(files)), chunksize=64), 1):
            resized += was_resized
            report(label, done, len(files))
    if unreadable:
        raise UserError(
            f"{key}: {len(unreadable)} unreadable image(s) in {str(folder)!r}: {'; '.join(sorted(unreadable)[:5])}"
            f"{' ...' if len(unreadable) > 5 else ''} (remove or re-export them)"
        )
    if resized:
        log.warning("%s: resized %d of %d images to %dx%d", key, resized, len(files), width, height)
    return CaptchaArrays(images, labels)


# ---------------------------------------------------------------------------------------------
# Synthetic set


class _SeededSecrets:
    """Stands in for the `secrets` module inside `captcha.image` (0.7.x draws all randomness there)."""

    def __init__(self, rng: random.Random):
        self._rng = rng

    def randbelow(self, n: int) -> int:
        return self._rng.randrange(n)

    def randbits(self, k: int) -> int:
        return self._rng.getrandbits(k)

    def choice(self, seq):
        return self._rng.choice(seq)


def render_captcha(generator, text: str, rng: random.Random):
    """One captcha image, every random draw taken from `rng` (reproducible, order-independent)."""
    import captcha.image

    real = captcha.image.secrets
    captcha.image.secrets = _SeededSecrets(rng)
    try:
        return generator.generate_image(text)
    finally:
        captcha.image.secrets = real


def _image_rng(seed: int, split: str, index: int) -> random.Random:
    # seeded from (seed, split, index) alone, so any process can render any image
    return random.Random(f"raysweep/{seed}/{split}/{index}")


def _render_range(args) -> tuple[int, np.ndarray, np.ndarray]:
    start, stop, seed, split, charset, length, width, height = args
    from captcha.image import ImageCaptcha

    generator = ImageCaptcha(width=width, height=height)
    images = np.empty((stop - start, height, width), dtype=np.uint8)
    labels = np.empty((stop - start, length), dtype=np.uint8)
    for j, i in enumerate(range(start, stop)):
        rng = _image_rng(seed, split, i)
        text = "".join(rng.choice(charset) for _ in range(length))
        images[j] = np.asarray(render_captcha(generator, text, rng).convert("L"))
        labels[j] = encode_label(text, charset)
    return start, images, labels


def cache_dir() -> Path:
    """`$RAYSWEEP_CACHE_DIR`, else `$XDG_CACHE_HOME/raysweep`, else `~/.cache/raysweep`."""
    if os.environ.get("RAYSWEEP_CACHE_DIR"):
        return Path(os.environ["RAYSWEEP_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raysweep"


def synthetic_split(
    split: str, size: int, seed: int, charset: str, length: int, width: int, height: int,
    progress: ProgressFn | None = None,
) -> CaptchaArrays:
    """`size` seeded captchas for `split`, rendered in parallel once, then read from the cache."""
    import captcha

    key = dict(
        v=GENERATOR_VERSION, captcha=getattr(captcha, "__version__", "?"), split=split, size=size, seed=seed,
        charset=charset, length=length, width=width, height=height,
    )
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"synthetic-{split}-{size}-{digest}.npz"
    if path.is_file():
        with np.load(path) as cached:
            return CaptchaArrays(cached["images"], cached["labels"])
    images = np.empty((size, height, width), dtype=np.uint8)
    labels = np.empty((size, length), dtype=np.uint8)
    chunk = 256
    tasks = [(a, min(a + chunk, size), seed, split, charset, length, width, height) for a in range(0, size, chunk)]
    report, label, done = progress or _quiet, f"generating synthetic {split} captchas", 0
    report(label, 0, size)
    workers = min(len(tasks), os.cpu_count() or 1)
    # spawn, not fork: the caller may already run Ray's threads
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for start, imgs, labs in pool.map(_render_range, tasks):
            images[start : start + len(imgs)] = imgs
            labels[start : start + len(labs)] = labs
            done += len(imgs)
            report(label, done, size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, images=images, labels=labels)
    os.replace(tmp, path)  # atomic: a killed run never leaves a half-written cache behind
    return CaptchaArrays(images, labels)


def synthetic_data(cfg, progress: ProgressFn | None = None) -> CaptchaData:
    s = cfg.synthetic
    shape = (cfg.charset, cfg.length, cfg.width, cfg.height)
    train = synthetic_split("train", s.train_size, s.seed, *shape, progress=progress)
    val = synthetic_split("val", s.val_size, s.seed, *shape, progress=progress)
    return CaptchaData(train, val, source=f"synthetic (seed {s.seed}, {s.train_size} train / {s.val_size} val)")


def write_captcha_folder(
    folder: Path, count: int, charset: str, length: int, width: int, height: int, seed: int = 0
) -> list[Path]:
    """Write `count` seeded captchas as `TEXT_index.png` files (a data folder, for tests and demos)."""
    from captcha.image import ImageCaptcha

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = ImageCaptcha(width=width, height=height)
    paths = []
    for i in range(count):
        rng = _image_rng(seed, "folder", i)
        text = "".join(rng.choice(charset) for _ in range(length))
        path = folder / f"{text}_{i:06d}.png"
        render_captcha(generator, text, rng).save(path)
        paths.append(path)
    return paths
