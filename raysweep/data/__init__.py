"""Captcha images → decoded uint8 arrays, once per sweep. The training loop never opens an image.

  arrays.py     the records handed on (CaptchaArrays, CaptchaData, the facts `check` shows), the cache folder
  folder.py     a user's folder: listing, labels, decoding with every conversion stated, the decoded cache
  synthetic.py  the seeded synthetic set (the embedded default) and seeded captcha folders for tests
  describe.py   the notes a sweep states and logs, and what `check` describes (spread, leakage)

With no folder configured, the synthetic set is rendered (and cached). With `data.train_dir` alone, a seeded
`data.val_fraction` of it is held out; with `data.val_dir` too, that folder validates. Nothing downstream depends
on the order of the files: every rank's share of an epoch is a uniform sample (worker/shard.py).
"""

from __future__ import annotations

import numpy as np

from raysweep.data.arrays import (
    CaptchaArrays,
    CaptchaData,
    DataFacts,
    FolderFacts,
    ProgressFn,
    cache_dir,
    encode_label,
)
from raysweep.data.synthetic import synthetic_split, write_captcha_folder
from raysweep.errors import UserError

SPLIT_SEED = 0  # hold-out split of a single folder: fixed, so every trial and sweep sees the same split

__all__ = ["CaptchaArrays", "CaptchaData", "DataFacts", "FolderFacts", "ProgressFn", "SPLIT_SEED", "cache_dir",
           "encode_label", "held_out", "load_data", "read_folder", "synthetic_split", "train_size",
           "write_captcha_folder"]


def train_size(cfg) -> int:
    """How many training images a `DataConfig` gives, without decoding any: the synthetic set's size, or the
    folder's image files (less the held-out share): what the search's batches are checked against before Ray."""
    from raysweep.data.folder import list_folder

    if cfg.train_dir is None:
        return cfg.synthetic.train_size
    n = len(list_folder(cfg.train_dir, "data.train_dir")[0])
    return n if cfg.val_dir is not None else n - held_out(n, cfg.val_fraction)


def held_out(n: int, val_fraction: float) -> int:
    """Images of a folder of n held out for validation (data.val_fraction, at least one, and fewer than n)."""
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise UserError(f"data.train_dir: {n} images are too few to hold out val_fraction {val_fraction}; add "
                        f"images, or give a validation folder (data.val_dir)")
    return n_val


def load_data(cfg, progress: ProgressFn | None = None) -> CaptchaData:
    """The train/val arrays for a `DataConfig`: from folders, else the (cached) synthetic set; what reading them
    converted or found is in `.notes` (one line each) and `.facts`."""
    from raysweep.data.describe import leakage, notes
    from raysweep.data.folder import read_folder
    from raysweep.data.synthetic import synthetic_data

    if cfg.train_dir is None:
        return synthetic_data(cfg, progress=progress)
    shape = (cfg.charset, cfg.length, cfg.width, cfg.height)
    train = read_folder(cfg.train_dir, *shape, "data.train_dir", progress, cfg.channels)
    if cfg.val_dir is not None:
        val = read_folder(cfg.val_dir, *shape, "data.val_dir", progress, cfg.channels)
        source, val_facts = f"{cfg.train_dir} + {cfg.val_dir}", val.facts
    else:
        n = len(train.names)
        n_val = held_out(n, cfg.val_fraction)
        order = np.random.default_rng(SPLIT_SEED).permutation(n)
        train, val = train.subset(np.sort(order[n_val:])), train.subset(np.sort(order[:n_val]))
        source, val_facts = f"{cfg.train_dir} (val_fraction {cfg.val_fraction})", None
    facts = DataFacts(train.facts, val_facts, *leakage(train, val))
    return CaptchaData(train.arrays, val.arrays, source, notes(facts, cfg), facts)


def read_folder(folder, charset: str, length: int, width: int, height: int, key: str = "data.train_dir",
                progress: ProgressFn | None = None, channels: int = 1) -> CaptchaArrays:
    """One folder's decoded arrays (data.folder.read_folder has the file names and facts too)."""
    from raysweep.data.folder import read_folder as read

    return read(folder, charset, length, width, height, key, progress, channels).arrays
