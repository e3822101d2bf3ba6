"""Garbage collection: what crashed or failed saves leave behind, removed once it is surely dead.

Left behind by a crash can be: tag folders without a manifest (a save that never committed) or
with one that cannot be read (a corrupt tag, which is never loaded),
``.partial`` files (a write cut off mid-file), commit markers, and on S3 multipart uploads that
were never completed or aborted (their parts are stored, and billed, until aborted). Anything
younger than the grace period may belong to a save still in progress and is left alone.
Committed tags are never touched, nor is the folder ``latest`` or ``latest_universal`` names: without
a manifest that is a checkpoint stock DeepSpeed wrote (say, before the engine was wrapped), not a
save of ours that died; while either file cannot be read, no folder without a manifest is removed.
Any other folder under the root without a manifest counts as a dead save, so point gc at a root
only async_ckpt (or stock DeepSpeed, named by ``latest``) writes to.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from async_ckpt.catalog import inspect_latest, list_tags
from async_ckpt.layout import LATEST, LATEST_UNIVERSAL, MARKER_DIR
from async_ckpt.storage.base import Storage

logger = logging.getLogger("async_ckpt")


@dataclass
class GcReport:
    dry_run: bool
    incomplete_tags: list[str] = field(default_factory=list)
    corrupt_tags: list[str] = field(default_factory=list)
    partial_files: list[str] = field(default_factory=list)
    marker_dirs: list[str] = field(default_factory=list)
    aborted_uploads: list[str] = field(default_factory=list)
    kept_latest: list[str] = field(default_factory=list)  # uncommitted folders kept: a latest file names them (or may)


def _newest_mtime(storage: Storage, relpath: str) -> float:
    """The newest time of anything under ``relpath``. A folder without files yet (a save that has
    just begun) counts with its own time, or as new where the store keeps none: never as old."""
    times = [storage.modified(p) for p in storage.iter_files(relpath)]
    if times:
        return max(times)
    try:
        created = storage.modified(relpath)
    except (OSError, KeyError):
        created = 0.0
    return created if created > 0 else time.time()


def collect_garbage(storage: Storage, *, grace_s: float = 3600.0, dry_run: bool = False) -> GcReport:
    """Remove (or with ``dry_run`` only list) garbage older than ``grace_s`` seconds."""
    report = GcReport(dry_run=dry_run)
    cutoff = time.time() - grace_s
    named, unreadable = set(), []
    for name in (LATEST, LATEST_UNIVERSAL):
        tag, why = inspect_latest(storage, name)
        named.add(tag)
        if why:
            unreadable.append(f"{name!r} cannot be read ({why})")
    if unreadable:
        logger.warning("gc %s: %s; folders without a readable manifest are kept, as it may name one of them",
                       storage.url, "; ".join(unreadable))
    for info in list_tags(storage):
        if not info.committed:
            if info.tag in named or unreadable:
                report.kept_latest.append(info.tag)
                logger.info("gc %s: %s has no manifest async_ckpt can read, but 'latest' names it (or may): kept "
                            "(a checkpoint stock DeepSpeed wrote?)", storage.url, info.tag)
            elif _newest_mtime(storage, info.tag) < cutoff:
                (report.corrupt_tags if info.error else report.incomplete_tags).append(info.tag)
                if not dry_run:
                    storage.delete(info.tag, recursive=True)
            continue
        for path in storage.iter_files(info.tag):
            if path.endswith(".partial") and storage.modified(path) < cutoff:
                report.partial_files.append(path)
                if not dry_run:
                    storage.delete(path)
        markers = f"{info.tag}/{MARKER_DIR}"
        if storage.is_dir(markers) and _newest_mtime(storage, markers) < cutoff:
            report.marker_dirs.append(markers)
            if not dry_run:
                storage.delete(markers, recursive=True)
    for key, upload_id, started in storage.list_incomplete_uploads():
        if started < cutoff:
            report.aborted_uploads.append(key)
            if not dry_run:
                storage.abort_upload(key, upload_id)
    logger.info("gc %s%s: %d incomplete tag(s), %d corrupt tag(s), %d partial file(s), %d marker folder(s), "
                "%d upload(s)", storage.url, " (dry run)" if dry_run else "", len(report.incomplete_tags),
                len(report.corrupt_tags), len(report.partial_files),
                len(report.marker_dirs), len(report.aborted_uploads))
    return report
