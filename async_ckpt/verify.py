"""Check a tag's files against its manifest: sizes and CRC-32, file by file."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from async_ckpt.layout import is_deepspeed_shard
from async_ckpt.manifest import FileEntry, Manifest
from async_ckpt.serialization import crc32_of_stream
from async_ckpt.storage.base import Storage


@dataclass(frozen=True)
class FileCheck:
    path: str
    ok: bool
    problem: str = ""
    expected_size: int = 0
    actual_size: int | None = None
    expected_crc32: str = ""
    actual_crc32: str | None = None
    #: Missing from a local tier's node folder because another node's ranks wrote it (:func:`on_other_nodes`):
    #: not a failure of this folder.
    elsewhere: bool = False


def check_local_file(path: str, entry: FileEntry, rel: str | None = None) -> FileCheck:
    """Compare one local file with its manifest entry."""
    rel = rel or entry.path
    base = {"path": rel, "expected_size": entry.size, "expected_crc32": entry.crc32}
    try:
        size = os.path.getsize(path)
    except OSError:
        return FileCheck(ok=False, problem="missing", **base)
    if size != entry.size:
        return FileCheck(ok=False, problem=f"size {size} != expected {entry.size}", actual_size=size, **base)
    try:  # gone since, or unreadable (an I/O error): a failed check, not a raise out of the whole verification
        with open(path, "rb") as fh:
            _, crc = crc32_of_stream(fh)
    except FileNotFoundError:
        return FileCheck(ok=False, problem="missing", **base)
    except OSError as exc:
        return FileCheck(ok=False, problem=f"unreadable ({exc.strerror or exc})", actual_size=size, **base)
    if crc != entry.crc32:
        return FileCheck(ok=False, problem=f"crc32 {crc} != expected {entry.crc32}", actual_size=size,
                         actual_crc32=crc, **base)
    return FileCheck(ok=True, actual_size=size, actual_crc32=crc, **base)


def check_stored_file(storage: Storage, tag: str, entry: FileEntry) -> FileCheck:
    """Compare one file in ``storage`` with its manifest entry (reads it through once)."""
    local = storage.local_dir()
    if local is not None:
        return check_local_file(os.path.join(local, tag, *entry.path.split("/")), entry)
    base = {"path": entry.path, "expected_size": entry.size, "expected_crc32": entry.crc32}
    try:
        with storage.open_read(f"{tag}/{entry.path}") as stream:
            size, crc = crc32_of_stream(stream)
    except FileNotFoundError:
        return FileCheck(ok=False, problem="missing", **base)
    if size != entry.size:
        return FileCheck(ok=False, problem=f"size {size} != expected {entry.size}", actual_size=size, **base)
    if crc != entry.crc32:
        return FileCheck(ok=False, problem=f"crc32 {crc} != expected {entry.crc32}", actual_size=size,
                         actual_crc32=crc, **base)
    return FileCheck(ok=True, actual_size=size, actual_crc32=crc, **base)


def verify_tag(storage: Storage, manifest: Manifest, paths: list[str] | None = None) -> list[FileCheck]:
    """Check every file of the tag (or just ``paths``)."""
    wanted = set(paths) if paths is not None else None
    return [check_stored_file(storage, manifest.tag, e) for e in manifest.files if wanted is None or e.path in wanted]


def unlisted_shards(storage: Storage, manifest: Manifest) -> list[FileCheck]:
    """DeepSpeed shards in the tag's folder that its manifest does not list (another save's: a killed save
    of the tag in another layout, an ``overwrite_tags`` save over a larger one): the files all match, yet
    DeepSpeed's loaders and tools glob the folder (itself, not its subfolders) and would read these with the
    save's own."""
    listed = {entry.path for entry in manifest.files}
    return [FileCheck(name, False, "not in the manifest: another save's shard, which DeepSpeed's tools would read "
                                   "with this save's files")
            for name in sorted(storage.list_dir(manifest.tag))
            if name not in listed and is_deepspeed_shard(name) and not storage.is_dir(f"{manifest.tag}/{name}")]


def on_other_nodes(manifest: Manifest, checks: list[FileCheck]) -> list[FileCheck]:
    """``checks`` with the files missing because another node holds them marked ``elsewhere``.

    A local tier's node folder lists every rank's files in its manifest (a resumed drain commits the
    whole tag at the URL from it) but holds only its own ranks' (``manifest.node_ranks``): a missing file
    of another rank is another node's, one of its own ranks' is a failure. A manifest without
    ``node_ranks`` (at the URL, or a node folder an earlier version committed) holds every file it lists."""
    if not manifest.node_ranks:
        return checks
    rank_of = {entry.path: entry.rank for entry in manifest.files}
    return [replace(c, elsewhere=True) if c.problem == "missing" and rank_of[c.path] not in manifest.node_ranks
            else c for c in checks]
