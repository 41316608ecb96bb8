"""What a sweep's data holds, in words and numbers: the notes a sweep states once and logs (every conversion, and
leakage between the folders), and the description `check` prints (counts, sizes, the characters found against
data.charset and how evenly they spread per position). Pure functions: the console prints them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raysweep.data.arrays import CaptchaData, DataFacts, FolderFacts
from raysweep.data.folder import MODE_NAMES, FolderImages

SHOWN = 3  # names or sizes spelled out in one note, at most


def leakage(train: FolderImages, val: FolderImages) -> tuple[int, tuple[str, str] | None]:
    """How many validation images have the pixels of a training image, and one such (val file, train file)."""
    leaked = np.isin(val.hashes, train.hashes)
    if not leaked.any():
        return 0, None
    first = int(np.flatnonzero(leaked)[0])
    match = int(np.flatnonzero(train.hashes == val.hashes[first])[0])
    return int(leaked.sum()), (val.names[first], train.names[match])


def _counted(counts: dict, names: dict | None = None, most: int = SHOWN) -> str:
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{(names or {}).get(k, k)} ({n:,})" for k, n in items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _n(count: int, noun: str) -> str:
    """`1 label`, `2 labels`, `1,234 labels`."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def folder_notes(f: FolderFacts, width: int, height: int, channels: int = 1) -> list[str]:
    """One line per change reading the folder made, and per file it left out (`channels`: data.channels, what the
    images were read as)."""
    lines = []
    if f.folded:
        other = "lowercase" if f.fold == "uppercase" else "uppercase"
        lines.append(f"{f.key}: {_n(f.folded, 'label')} with {other} letters read as {f.fold} (data.charset's letters "
                     f"are all {f.fold}; give it both cases to tell them apart)")
    native = "RGB" if channels == 3 else "L"
    converted = {m: n for m, n in f.modes.items() if m != native}
    if converted:
        lines.append(f"{f.key}: {sum(converted.values()):,} of {f.images:,} images read as 8-bit "
                     f"{'RGB' if channels == 3 else 'grayscale'} from "
                     f"{_counted(converted, MODE_NAMES, most=len(converted))}")
    if f.resized:
        other = {s: n for s, n in f.sizes.items() if s != f"{width}×{height}"}
        lines.append(f"{f.key}: {f.resized:,} of {f.images:,} images resized to {width}×{height} (data.width × "
                     f"data.height) from {_counted(other)}")
    not_png = {k: n for k, n in f.formats.items() if k != "PNG"}
    if not_png:
        lines.append(f"{f.key}: {sum(not_png.values()):,} of {f.images:,} images are {_counted(not_png)}, not PNG")
    if f.ignored:
        more = f" and {len(f.ignored) - SHOWN} more" if len(f.ignored) > SHOWN else ""
        lines.append(f"{f.key}: ignored {_n(len(f.ignored), 'file')} without an image suffix: "
                     f"{', '.join(f.ignored[:SHOWN])}{more}")
    return lines


def notes(facts: DataFacts, cfg) -> tuple[str, ...]:
    """Everything reading the data changed or found, one line each (`cfg`: the DataConfig)."""
    lines = []
    for folder in (facts.train, facts.val):
        if folder is not None:
            lines += folder_notes(folder, cfg.width, cfg.height, cfg.channels)
    if facts.val_in_train:
        val_file, train_file = facts.leak_example
        key = "data.val_dir" if facts.val is not None else "data.val_fraction"
        held = "" if facts.val is not None else " held out of data.train_dir"
        lines.append(f"{key}: {_n(facts.val_in_train, 'validation image')}{held} with the pixels of a training image, "
                     f"e.g. {val_file} = {train_file}: validation overstates accuracy; remove them from one folder")
    return tuple(lines)


@dataclass(frozen=True)
class PositionSpread:
    """How the characters at one position of the labels spread: how many of the charset appear, the shares of the
    least and most common (uniform: 1 / len(charset))."""

    position: int  # 1-based
    present: int
    least: tuple[str, float]  # (character, share)
    most: tuple[str, float]


@dataclass(frozen=True)
class DataDescription:
    """What `check` says of the data a sweep will train on."""

    source: str
    train_size: int
    val_size: int
    facts: DataFacts | None
    notes: tuple[str, ...]
    charset_size: int
    absent: str  # characters of data.charset no training label holds
    val_unseen: str  # characters a validation label holds that no training label does
    spread: tuple[PositionSpread, ...]


def describe(data: CaptchaData, charset: str) -> DataDescription:
    counts = np.stack([np.bincount(data.train.labels[:, p], minlength=len(charset))
                       for p in range(data.train.labels.shape[1])])
    in_train = counts.sum(axis=0) > 0
    in_val = np.bincount(data.val.labels.ravel(), minlength=len(charset)) > 0 if len(data.val) else in_train
    spread = []
    for p, row in enumerate(counts):
        share = row / max(row.sum(), 1)
        seen = np.flatnonzero(row)
        low = seen[np.argmin(row[seen])] if len(seen) else 0
        spread.append(PositionSpread(p + 1, len(seen), (charset[low], float(share[low])),
                                     (charset[int(np.argmax(row))], float(share.max()))))
    return DataDescription(
        data.source, len(data.train), len(data.val), data.facts, data.notes, len(charset),
        "".join(c for c, seen in zip(charset, in_train) if not seen),
        "".join(c for c, seen, v in zip(charset, in_train, in_val) if v and not seen), tuple(spread))


MAX_PARAM_CHARS = 6000  # MLflow 3's longest param value (MAX_PARAM_VAL_LENGTH, mlflow/utils/validation.py)


def mlflow_params(data: CaptchaData) -> dict[str, str]:
    """The data a sweep trained on, as its parent run's MLflow params: where it came from, its sizes, every
    conversion or finding (`notes`, one line each, " | " between) and the leakage count."""
    facts = data.facts
    return {"data.source": data.source[:MAX_PARAM_CHARS], "data.train_images": str(len(data.train)),
            "data.val_images": str(len(data.val)),
            "data.notes": (" | ".join(data.notes) or "none")[:MAX_PARAM_CHARS],
            "data.val_in_train": str(facts.val_in_train if facts is not None else 0)}
