"""A user's captcha folder → decoded uint8 arrays, with every odd thing it holds answered.

A folder holds `TEXT_anything.png` or `TEXT.png` files: the label is the file name up to its first `_` (or its
suffix). What users' folders hold, and what happens to it:
- images in any mode PIL reads (RGB, RGBA and LA on white, palette, 1-bit, 16-bit scaled to 8), as PNG, JPEG,
  BMP, GIF or WebP: read as 8-bit grayscale, or 8-bit RGB where data.channels is 3; another size: resized to
  data.width × data.height. Each such
  conversion is one line of `FolderFacts`/notes, stated on the console and logged with the sweep.
- labels in the other case than data.charset's letters (`a3bd` with the default uppercase charset): read in the
  charset's case, stated likewise. Any other label the charset or data.length cannot take: one error line naming
  the files and the fix.
- a file that is not an image (by suffix: notes, .DS_Store; or macOS's AppleDouble `._NAME` beside each file, left
  by a copy through a FAT or network share): ignored, by name; one with an image suffix that does not decode (not
  an image, truncated): one error line naming the files.

Decoding ~50,000 files takes a while (benchmarks/RESULTS.md, folder_scale): the decoded images are cached under
the user cache directory, keyed by the folder's listing (names, sizes, modification times) and the image size,
so a second sweep on an unchanged folder decodes nothing; a changed file makes a new cache (the old one of that
image size and channels goes; specs that read the folder at other sizes or in other channels keep theirs).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raysweep.data.arrays import (
    CaptchaArrays,
    FolderFacts,
    ProgressFn,
    cache_dir,
    charset_index,
    quiet,
    save_npz,
)
from raysweep.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
DECODER_VERSION = 2  # bump when decoding below changes what an image becomes, so old caches are not reused
APPLE_DOUBLE = "._"  # macOS's resource fork beside a file copied to a FAT or network share: never an image
NAMED = 5  # files named in one error line, at most


@dataclass(frozen=True)
class Entry:
    """One image file of a folder's listing: what the cache is keyed by."""

    name: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class FolderImages:
    """A folder decoded: its arrays, each image's file name and pixel hash (for leakage), and its facts."""

    arrays: CaptchaArrays
    names: list[str]
    hashes: np.ndarray  # uint64, one per image: a hash of its decoded pixels
    facts: FolderFacts

    def subset(self, idx: np.ndarray) -> FolderImages:
        arrays = CaptchaArrays(self.arrays.images[idx], self.arrays.labels[idx])
        return FolderImages(arrays, [self.names[i] for i in idx], self.hashes[idx], self.facts)


def label_text(name: str) -> str:
    """`A1B2_0007.png` → `A1B2`; `A1B2.png` → `A1B2`."""
    stem = name.rsplit(".", 1)[0]
    return stem.split("_", 1)[0]


def list_folder(folder: Path, key: str) -> tuple[list[Entry], list[str]]:
    """The folder's image files, sorted by name, and the names of the other files (ignored); a folder with no image
    is one error line (one of folders: which to name)."""
    if not folder.is_dir():
        raise UserError(f"{key}: no such folder {str(folder)!r}")
    entries, ignored, folders, broken = [], [], [], []
    try:
        with os.scandir(folder) as listing:
            for item in listing:
                if item.is_dir():
                    folders.append(item.name)
                elif item.name.lower().endswith(IMAGE_SUFFIXES) and not item.name.startswith(APPLE_DOUBLE):
                    try:
                        stat = item.stat()
                    except OSError as e:  # a link to nowhere, a file gone while listed
                        broken.append(f"{item.name} ({e.strerror or type(e).__name__})")
                        continue
                    entries.append(Entry(item.name, stat.st_size, stat.st_mtime_ns))
                else:
                    ignored.append(item.name)
    except OSError as e:
        raise UserError(f"{key}: cannot list {str(folder)!r} ({e.strerror or type(e).__name__}); give this user read "
                        f"access to it") from None
    if broken:
        raise UserError(f"{key}: {len(broken)} file(s) in {str(folder)!r} cannot be read: "
                        f"{'; '.join(sorted(broken)[:NAMED])}{' ...' if len(broken) > NAMED else ''} (remove them, or "
                        f"point the links at the images)")
    if not entries:
        if folders:
            shown = ", ".join(f"{f}/" for f in sorted(folders)[:NAMED])
            raise UserError(f"{key}: no images in {str(folder)!r}, only folders ({shown}): name the folder that holds "
                            f"the images (e.g. data.train_dir: {folder / sorted(folders)[0]})")
        fix = "; or set data.val_dir: null to hold out data.val_fraction of data.train_dir" if key == "data.val_dir" \
            else ""
        raise UserError(f"{key}: no images ({', '.join(IMAGE_SUFFIXES)}) in {str(folder)!r} (expected files named "
                        f"TEXT_anything.png or TEXT.png){fix}")
    entries.sort(key=lambda e: e.name)
    return entries, sorted(ignored)


def _fold(charset: str):
    """str.upper when data.charset's letters are all uppercase (a lowercase label means the same captcha),
    str.lower when all lowercase; None when it has both cases (or no letters): case then tells characters apart."""
    letters = [c for c in charset if c in string.ascii_letters]
    if letters and all(c.isupper() for c in letters):
        return str.upper
    if letters and all(c.islower() for c in letters):
        return str.lower
    return None


def read_labels(entries: list[Entry], charset: str, length: int, folder: Path,
                key: str) -> tuple[np.ndarray, int, str]:
    """Every file's label as charset indices (N, length) uint8, how many were read in the charset's case, and that
    case ("uppercase", "lowercase", "" when none was); labels the charset or length cannot take are one error line
    naming up to five files and the fix."""
    allowed, fold = set(charset), _fold(charset)
    texts, folded, wrong_length, outside = [], 0, [], []
    for entry in entries:
        text = label_text(entry.name)
        if fold is not None and not set(text) <= allowed and fold(text) != text:
            text, folded = fold(text), folded + 1  # what still lies outside the charset is named below
        if len(text) != length:
            wrong_length.append((entry.name, text))
        elif not set(text) <= allowed:
            outside.append((entry.name, text))
        texts.append(text)
    if wrong_length or outside:
        raise UserError(_bad_labels(wrong_length, outside, len(entries), length, allowed, folder, key))
    index = charset_index(charset)
    labels = np.array([[index[c] for c in text] for text in texts], dtype=np.uint8).reshape(len(texts), length)
    return labels, folded, ("uppercase" if fold is str.upper else "lowercase") if folded else ""


def _bad_labels(wrong_length: list, outside: list, total: int, length: int, allowed: set, folder: Path,
                key: str) -> str:
    """The one line for labels that cannot be read: the count, up to five files and why, the fix."""
    shown = [f"{name} (label {text!r} has {len(text)} characters, not {length})" for name, text in wrong_length]
    shown += [f"{name} (label {text!r} has {''.join(sorted(set(text) - allowed))!r}, not in data.charset)"
              for name, text in outside]
    lengths = Counter(len(text) for _, text in wrong_length)
    if wrong_length and not outside and len(wrong_length) == total and len(lengths) == 1:
        fix = f"every label has {next(iter(lengths))} characters: set data.length: {next(iter(lengths))}"
    elif outside and not wrong_length:
        missing = "".join(sorted({c for _, text in outside for c in text} - allowed))
        fix = f"add {missing!r} to data.charset, or rename the files"
    else:
        fix = "name files TEXT_anything.png or TEXT.png, or change data.charset / data.length"
    more = " ..." if len(shown) > NAMED else ""
    return (f"{key}: {len(shown)} of {total} files in {str(folder)!r} have bad labels: {'; '.join(shown[:NAMED])}"
            f"{more} ({fix})")


def read_folder(folder: Path, charset: str, length: int, width: int, height: int, key: str = "data.train_dir",
                progress: ProgressFn | None = None, channels: int = 1) -> FolderImages:
    """Every image of a folder, decoded to (N, height, width) uint8 grayscale (channels 1) or (N, height, width, 3)
    RGB (channels 3) with its label (or read from the cache of an earlier decode of the same listing). Bad labels
    and files that do not decode are one error line each, naming up to five files."""
    folder = Path(folder)
    entries, ignored = list_folder(folder, key)
    labels, folded, fold = read_labels(entries, charset, length, folder, key)
    path = _cache_path(folder, entries, width, height, channels)
    cached = _load_cache(path)
    if cached is None:
        images, hashes, counts = _decode_all(folder, entries, width, height, key, progress or quiet, channels)
        if save_npz(path, images=images, hashes=hashes, counts=np.array(json.dumps(counts))):
            kind = path.name.rsplit("-", 1)[0]  # this folder at this image size and channels: its older listings go
            for stale in path.parent.glob(f"{kind}-*.npz"):
                if stale != path:
                    stale.unlink(missing_ok=True)
    else:
        images, hashes, counts = cached
    facts = FolderFacts(
        key=key, folder=str(folder), images=len(entries), formats=counts["formats"], modes=counts["modes"],
        sizes=counts["sizes"], resized=counts["resized"], folded=folded, fold=fold, ignored=tuple(ignored),
        duplicates=len(hashes) - len(np.unique(hashes)), from_cache=cached is not None)
    return FolderImages(CaptchaArrays(images, labels), [e.name for e in entries], hashes, facts)


def _cache_path(folder: Path, entries: list[Entry], width: int, height: int, channels: int = 1) -> Path:
    """`<cache>/folders/<folder's path digest>-<W>x<H>[xC]-<listing digest>.npz`: a new listing (a file added,
    removed, rewritten or touched) is a new file; another image size or channel count is another file beside it
    (two specs on one folder). Grayscale keeps the name it always had (the caches made before RGB stay valid)."""
    where = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    listing = json.dumps([DECODER_VERSION, width, height, [(e.name, e.size, e.mtime_ns) for e in entries]]
                         + ([channels] if channels != 1 else []))
    size = f"{width}x{height}" + (f"x{channels}" if channels != 1 else "")
    return cache_dir() / "folders" / f"{where}-{size}-{hashlib.sha256(listing.encode()).hexdigest()[:16]}.npz"


def _load_cache(path: Path) -> tuple[np.ndarray, np.ndarray, dict] | None:
    """The cached decode, or None: absent, or unreadable (a disk that filled up): decoded again."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as cached:
            return cached["images"], cached["hashes"], json.loads(str(cached["counts"]))
    except Exception:  # any damage means decoding again, never a wrong set
        return None


def _decode_all(folder: Path, entries: list[Entry], width: int, height: int, key: str, progress: ProgressFn,
                channels: int = 1):
    """Decode every file in threads (PIL decodes without the GIL), with progress; (images, pixel hashes, counts)."""
    images = np.empty((len(entries), height, width) + ((channels,) if channels > 1 else ()), dtype=np.uint8)
    hashes = np.empty(len(entries), dtype=np.uint64)
    facts: list[tuple[str, str, str] | None] = [None] * len(entries)
    unreadable: list[str] = []

    def decode(i: int) -> None:
        try:
            images[i], facts[i] = decode_image(folder / entries[i].name, width, height, channels)
        except Exception as e:  # whatever fails to decode is the file's fault: named in the error line
            unreadable.append(f"{entries[i].name} ({_why(e)})")
            return
        hashes[i] = int.from_bytes(hashlib.blake2b(images[i].tobytes(), digest_size=8).digest(), "little")

    label = f"decoding {folder.name or folder}"
    progress(label, 0, len(entries))
    with cf.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        for done, _ in enumerate(pool.map(decode, range(len(entries))), 1):
            progress(label, done, len(entries))
    if unreadable:
        raise UserError(
            f"{key}: {len(unreadable)} of {len(entries)} files in {str(folder)!r} cannot be read as images: "
            f"{'; '.join(sorted(unreadable)[:NAMED])}{' ...' if len(unreadable) > NAMED else ''} (remove them, or "
            f"export them again)")
    size = f"{width}×{height}"
    counts = {"formats": Counter(f[0] for f in facts), "modes": Counter(f[1] for f in facts),
              "sizes": Counter(f[2] for f in facts)}
    counts = {name: dict(c.most_common()) for name, c in counts.items()}
    counts["resized"] = sum(n for s, n in counts["sizes"].items() if s != size)
    return images, hashes, counts


def _why(e: Exception) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):
        return "not an image"
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "truncated" in text.lower() or isinstance(e, (EOFError, SyntaxError)):
        return f"truncated or damaged: {text}"
    return f"{type(e).__name__}: {text}"


# how each stored mode becomes 8-bit grayscale (or RGB), as the notes say it
MODE_NAMES = {"L": "grayscale", "RGB": "RGB", "RGBA": "RGBA (on white)", "LA": "gray + alpha (on white)",
              "P": "palette", "PA": "palette + alpha (on white)", "1": "1-bit", "I;16": "16-bit", "I;16B": "16-bit",
              "I;16L": "16-bit", "I;16N": "16-bit", "I": "16/32-bit integer", "CMYK": "CMYK", "F": "32-bit float"}


def decode_image(path: Path, width: int, height: int, channels: int = 1) -> tuple[np.ndarray, tuple[str, str, str]]:
    """One file as (height, width) uint8 grayscale, or (height, width, 3) RGB with `channels` 3, and (format,
    stored mode, stored W×H).

    Transparency is laid on white: captchas draw dark characters, and a transparent background read as black
    would hide them. 16-bit values are scaled to 8 bits (PIL's own conversion clips them at 255, so a 16-bit image
    with a transparent value (its tRNS chunk) is scaled first and only the pixels of that value made white)."""
    mode_out = "RGB" if channels == 3 else "L"
    from PIL import Image

    with Image.open(path) as im:
        im.load()  # decodes now: a truncated file raises here
        fmt, mode, size = im.format or path.suffix.lstrip(".").upper(), im.mode, im.size
        if mode.startswith("I"):
            values = np.asarray(im).astype(np.float64)
            scale = 257.0 if mode.startswith("I;16") or values.max(initial=0) > 255 else 1.0
            scaled = np.clip(np.rint(values / scale), 0, 255).astype(np.uint8)
            clear = im.info.get("transparency")
            if isinstance(clear, int):  # one gray value transparent (a grayscale PNG's tRNS)
                scaled[values == clear] = 255
            gray = Image.fromarray(scaled)
        elif mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
            white = Image.new("RGBA", im.size, (255, 255, 255, 255))
            gray = Image.alpha_composite(white, im.convert("RGBA")).convert(mode_out)
        else:
            gray = im.convert(mode_out)
        if gray.mode != mode_out:  # a 16-bit image scaled to 8-bit gray, read as RGB
            gray = gray.convert(mode_out)
        if gray.size != (width, height):
            gray = gray.resize((width, height), Image.Resampling.BILINEAR)
        return np.asarray(gray), (fmt, mode, f"{size[0]}×{size[1]}")
