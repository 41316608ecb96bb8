"""`storage_path`: a local folder, an NFS path or an `s3://`-style URI, read and written through pyarrow's
filesystems, the same layer Ray's own storage uses, so what Ray Train can write there, raysweep can too.

A URI may carry pyarrow's query options, e.g. `s3://bucket/sweeps?endpoint_override=host:9000&scheme=http`;
`join` keeps them at the end. Imports nothing from raysweep: the rank side uses it as well.
"""

from __future__ import annotations

import os
from pathlib import Path


def is_uri(location: str) -> bool:
    return "://" in location


def resolve(storage_path: str | os.PathLike) -> str:
    """An absolute location: a URI as it is, a local path expanded and made absolute (workers chdir)."""
    text = str(storage_path)
    return text if is_uri(text) else str(Path(text).expanduser().resolve())


def join(base: str, *parts: str) -> str:
    """`base`/part/… with a URI's `?query` kept at the end."""
    root, sep, query = base.partition("?") if is_uri(base) else (base, "", "")
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)]) + sep + query


def _fs(location: str):
    import pyarrow.fs

    if not is_uri(location):
        return pyarrow.fs.LocalFileSystem(), location
    return pyarrow.fs.FileSystem.from_uri(location)


def exists(location: str) -> bool:
    import pyarrow.fs

    fs, path = _fs(location)
    return fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound


def is_dir(location: str) -> bool:
    """A folder (local) or a prefix with objects under it (object stores have no empty folders)."""
    import pyarrow.fs

    fs, path = _fs(location)
    return fs.get_file_info(path).type == pyarrow.fs.FileType.Directory


def list_names(location: str) -> list[str]:
    """The names directly under a folder (or prefix), sorted; [] when there is none."""
    import pyarrow.fs

    if not is_dir(location):
        return []
    fs, path = _fs(location)
    return sorted(info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(path)))


def read_text(location: str) -> str | None:
    """The file's text, or None when there is no such file."""
    data = read_bytes(location)
    return None if data is None else data.decode()


def read_bytes(location: str) -> bytes | None:
    """The file's bytes, or None when there is no such file."""
    if not exists(location):
        return None
    fs, path = _fs(location)
    with fs.open_input_stream(path) as f:
        return f.readall()


def write_text(location: str, text: str) -> None:
    """Write a whole file, atomically (`write_bytes`)."""
    write_bytes(location, text.encode())


def write_bytes(location: str, data: bytes) -> None:
    """Write a whole file (its folder made first where the filesystem has folders), so that a reader, or a
    process killed mid-write, sees the old file or the new one and never a torn one: on a local or NFS path a
    temporary file beside it, flushed, then renamed over it (rename is atomic on both); an object store's put
    is whole already."""
    if is_uri(location):
        fs, path = _fs(location)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    path = Path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def delete_dir(location: str) -> None:
    """Remove a folder (or every object under a prefix) if it is there."""
    if exists(location):
        fs, path = _fs(location)
        fs.delete_dir(path)


def delete(location: str) -> None:
    """Remove a file if it is there."""
    if exists(location):
        fs, path = _fs(location)
        fs.delete_file(path)
