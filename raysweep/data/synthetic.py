"""The embedded default data set: seeded captchas rendered with `captcha.image.ImageCaptcha` in parallel
processes, cached under the user cache directory keyed by every parameter that changes its pixels; and
`write_captcha_folder`, which writes such captchas as a data folder (tests, benchmarks, demos)."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import json
import multiprocessing
import os
import random
from pathlib import Path

import numpy as np

from raysweep.data.arrays import CaptchaArrays, CaptchaData, ProgressFn, cache_dir, encode_label, quiet, save_npz

GENERATOR_VERSION = 1  # bump when the rendering below changes, so old caches are not reused

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
    start, stop, seed, split, charset, length, width, height, channels = args
    from captcha.image import ImageCaptcha

    generator = ImageCaptcha(width=width, height=height)
    images = np.empty((stop - start, height, width) + ((3,) if channels == 3 else ()), dtype=np.uint8)
    labels = np.empty((stop - start, length), dtype=np.uint8)
    for j, i in enumerate(range(start, stop)):
        rng = _image_rng(seed, split, i)
        text = "".join(rng.choice(charset) for _ in range(length))
        images[j] = np.asarray(render_captcha(generator, text, rng).convert("RGB" if channels == 3 else "L"))
        labels[j] = encode_label(text, charset)
    return start, images, labels


def _synthetic_path(split: str, size: int, seed: int, charset: str, length: int, width: int, height: int,
                    channels: int = 1) -> Path:
    import captcha

    key = dict(
        v=GENERATOR_VERSION, captcha=getattr(captcha, "__version__", "?"), split=split, size=size, seed=seed,
        charset=charset, length=length, width=width, height=height,
    )
    if channels != 1:  # grayscale keeps the key it always had (its caches stay valid)
        key["channels"] = channels
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"synthetic-{split}-{size}-{digest}.npz"


def synthetic_cached(cfg) -> bool:
    """Whether a `DataConfig`'s synthetic set is rendered already (reading it is then instant)."""
    s, shape = cfg.synthetic, (cfg.charset, cfg.length, cfg.width, cfg.height)
    return all(_synthetic_path(split, size, s.seed, *shape, cfg.channels).is_file()
               for split, size in (("train", s.train_size), ("val", s.val_size)))


def synthetic_split(
    split: str, size: int, seed: int, charset: str, length: int, width: int, height: int,
    progress: ProgressFn | None = None, channels: int = 1,
) -> CaptchaArrays:
    """`size` seeded captchas for `split` (grayscale, or RGB with `channels` 3: the same captchas, drawn in colour),
    rendered in parallel once, then read from the cache."""
    path = _synthetic_path(split, size, seed, charset, length, width, height, channels)
    if path.is_file():
        with np.load(path) as cached:
            return CaptchaArrays(cached["images"], cached["labels"])
    images = np.empty((size, height, width) + ((3,) if channels == 3 else ()), dtype=np.uint8)
    labels = np.empty((size, length), dtype=np.uint8)
    chunk = 256
    tasks = [(a, min(a + chunk, size), seed, split, charset, length, width, height, channels)
             for a in range(0, size, chunk)]
    report, label, done = progress or quiet, f"generating synthetic {split} captchas", 0
    report(label, 0, size)
    workers = min(len(tasks), os.cpu_count() or 1)
    # spawn, not fork: the caller may already run Ray's threads
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for start, imgs, labs in pool.map(_render_range, tasks):
            images[start : start + len(imgs)] = imgs
            labels[start : start + len(labs)] = labs
            done += len(imgs)
            report(label, done, size)
    save_npz(path, images=images, labels=labels)
    return CaptchaArrays(images, labels)


def synthetic_data(cfg, progress: ProgressFn | None = None) -> CaptchaData:
    s = cfg.synthetic
    shape = (cfg.charset, cfg.length, cfg.width, cfg.height)
    train = synthetic_split("train", s.train_size, s.seed, *shape, progress=progress, channels=cfg.channels)
    val = synthetic_split("val", s.val_size, s.seed, *shape, progress=progress, channels=cfg.channels)
    return CaptchaData(train, val, source=f"synthetic (seed {s.seed}, {s.train_size} train / {s.val_size} val)")


def folder_captcha_text(seed: int, index: int, charset: str, length: int) -> str:
    """The text of image `index` of a seeded captcha folder (write_captcha_folder), without rendering it."""
    rng = _image_rng(seed, "folder", index)
    return "".join(rng.choice(charset) for _ in range(length))


def write_captcha(path: Path, seed: int, index: int, charset: str, length: int, width: int, height: int) -> str:
    """Render image `index` of a seeded captcha folder to `path` (any name, any format PIL writes); its text."""
    rng = _image_rng(seed, "folder", index)
    text = "".join(rng.choice(charset) for _ in range(length))  # the draws folder_captcha_text makes, in order
    render_captcha(_generator(width, height), text, rng).save(path)
    return text


@functools.lru_cache(maxsize=4)
def _generator(width: int, height: int):
    """One ImageCaptcha per size and process (it loads its fonts once; it draws nothing random itself)."""
    from captcha.image import ImageCaptcha

    return ImageCaptcha(width=width, height=height)


def write_captcha_folder(
    folder: Path, count: int, charset: str, length: int, width: int, height: int, seed: int = 0
) -> list[Path]:
    """Write `count` seeded captchas as `TEXT_index.png` files (a data folder, for tests and demos)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        text = folder_captcha_text(seed, i, charset, length)
        path = folder / f"{text}_{i:06d}.png"
        write_captcha(path, seed, i, charset, length, width, height)
        paths.append(path)
    return paths
