"""Garbage collection: what crashed or failed saves leave behind, removed once it is surely dead.

Left behind by a crash can be: tag folders without a manifest (a save that never committed) or
with one that cannot be read (a corrupt tag, which is never loaded),
``.partial`` files (a write cut off mid-file, in a tag or at the root), bookkeeping folders
(``.async_ckpt/``), write probes at the root, and on S3
multipart uploads that were never completed or aborted (their parts are stored, and billed, until
aborted). Anything younger than the grace period may belong to a save still in progress and is left
alone: a folder is as young as its newest file, or as the last part uploaded under it.

Only folders async_ckpt started are removed (whole). A tag whose manifest is in another version's
format is kept (``kept_unsupported``): that version may still use it. A folder without a manifest is
a save of ours that died only if it holds a start mark (every rank writes one before its first file
of a tag, :func:`async_ckpt.commit.mark_started`) or a deletion mark names it and none of its files
is newer (a deletion cut short, :func:`async_ckpt.commit.delete_tag`):
:func:`async_ckpt.catalog.started_here`.
Any other is kept and reported (``kept_foreign``): a checkpoint stock DeepSpeed wrote, say before
the engine was wrapped, has no manifest either. So is the folder ``latest`` or ``latest_universal``
names, and every folder without a manifest while either file cannot be read. An upload is aborted
only under a tag folder of ours (committed, corrupt or marked), so gc at a bucket's root leaves other
writers' uploads alone.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import ContextManager

from async_ckpt.catalog import inspect_latest, list_tags, modified_or_now, newest_mtime, started_here
from async_ckpt.commit import delete_tag, no_new_marks
from async_ckpt.layout import DELETION_MARKS, LATEST, LATEST_UNIVERSAL, MARKER_DIR, deletion_mark
from async_ckpt.storage.base import PROBE_PREFIX, Storage

logger = logging.getLogger("async_ckpt")


@dataclass
class GcReport:
    dry_run: bool
    incomplete_tags: list[str] = field(default_factory=list)
    corrupt_tags: list[str] = field(default_factory=list)
    partial_files: list[str] = field(default_factory=list)
    bookkeeping: list[str] = field(default_factory=list)  # committed tags' .async_ckpt/, stale deletion marks
    aborted_uploads: list[str] = field(default_factory=list)
    kept_latest: list[str] = field(default_factory=list)  # uncommitted folders kept: a latest file names them (or may)
    kept_foreign: list[str] = field(default_factory=list)  # folders without a manifest or a start mark: not ours
    kept_unsupported: list[str] = field(default_factory=list)  # manifests in another async_ckpt version's format
    kept_uploads: list[str] = field(default_factory=list)  # uploads outside our tag folders: not ours


def _collect_leftovers(storage: Storage, tag: str, cutoff: float, report: GcReport) -> None:
    """In a committed tag: ``.partial`` files and the bookkeeping folder older than ``cutoff``."""
    for path in storage.iter_files(tag):
        if path.endswith(".partial") and modified_or_now(storage, path) < cutoff:
            report.partial_files.append(path)
            if not report.dry_run:
                storage.delete(path)
    markers = f"{tag}/{MARKER_DIR}"
    with _holding_off_marks(storage, report.dry_run):
        if storage.is_dir(markers) and newest_mtime(storage, markers) < cutoff:
            report.bookkeeping.append(markers)
            if not report.dry_run:
                storage.delete(markers, recursive=True)


def _collect_root_leftovers(storage: Storage, cutoff: float, report: GcReport) -> None:
    """The root's own files older than ``cutoff`` that a killed process left: a ``.partial`` of ``latest``
    (or of a recovery script) cut short, and a write probe of ``wrap()`` or a CLI command."""
    for name in storage.list_dir():
        leftover = name.endswith(".partial") or name.startswith(PROBE_PREFIX)
        if not leftover or storage.is_dir(name) or modified_or_now(storage, name) >= cutoff:
            continue
        (report.partial_files if name.endswith(".partial") else report.bookkeeping).append(name)
        if not report.dry_run:
            storage.delete(name)


def _holding_off_marks(storage: Storage, dry_run: bool) -> ContextManager[None]:
    """Around a check that a folder is old and its deletion: in a node folder (one with the marks lock)
    no start mark lands meanwhile, so a save that reuses the tag's name, whose mark comes first, is
    either seen by the check (its mark is new) or writes into a fresh folder after the deletion.
    Elsewhere (a local URL, object storage) a mark written between the two is deleted with the folder."""
    return contextlib.nullcontext() if dry_run else no_new_marks(storage, create=False)


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
    deleting = set(storage.list_dir(DELETION_MARKS))
    uploads = storage.list_incomplete_uploads()  # first: a save whose only activity is an upload is alive
    active: dict[str, float] = {}
    aborted: set[str] = set()

    def under(tag: str) -> list[tuple[str, str, float]]:
        return [upload for upload in uploads if upload[0].split("/", 1)[0] == tag]

    def last_active(key: str, upload_id: str, started: float) -> float:
        """An upload's last activity: its start, or its newest part where it began before the cutoff
        (asked only of the uploads gc decides on, so other writers' are never looked into)."""
        if upload_id not in active:
            newest_part = storage.last_part_uploaded(key, upload_id) if started < cutoff else 0.0
            active[upload_id] = max(started, newest_part)
        return active[upload_id]

    def abort_if_old(key: str, upload_id: str, started: float) -> None:
        if upload_id not in aborted and last_active(key, upload_id, started) < cutoff:
            aborted.add(upload_id)
            report.aborted_uploads.append(key)
            if not dry_run:
                storage.abort_upload(key, upload_id)
    ours, uncommitted = set(), set()  # ours: tag folders async_ckpt wrote: committed, corrupt or marked
    for info in list_tags(storage):
        if info.unsupported:
            report.kept_unsupported.append(info.tag)
            logger.warning("gc %s: %s: kept, as this async_ckpt cannot tell whether it is garbage", storage.url,
                           info.error)
            continue
        if info.committed:
            ours.add(info.tag)
            _collect_leftovers(storage, info.tag, cutoff, report)
            continue
        uncommitted.add(info.tag)
        marked = info.error is not None or started_here(storage, info.tag)
        if marked:
            ours.add(info.tag)
        if info.tag in named or unreadable:
            report.kept_latest.append(info.tag)
            logger.info("gc %s: %s has no manifest async_ckpt can read, but 'latest' names it (or may): kept "
                        "(a checkpoint stock DeepSpeed wrote?)", storage.url, info.tag)
        elif not marked:
            report.kept_foreign.append(info.tag)
            logger.info("gc %s: %s has neither a manifest nor async_ckpt's start mark: kept, as async_ckpt did not "
                        "start it (a checkpoint stock DeepSpeed wrote?); remove it yourself if it is garbage",
                        storage.url, info.tag)
        else:
            with _holding_off_marks(storage, dry_run):
                last_upload = max((last_active(*upload) for upload in under(info.tag)), default=0.0)
                if max(newest_mtime(storage, info.tag), last_upload) < cutoff:
                    (report.corrupt_tags if info.error else report.incomplete_tags).append(info.tag)
                    for upload in under(info.tag):  # first: if this fails, the folder stays for the next run
                        abort_if_old(*upload)
                    if not dry_run:
                        delete_tag(storage, info.tag)
    foreign = uncommitted - ours
    ours |= deleting - foreign  # an upload under a tag being deleted is ours too
    for tag in deleting - (uncommitted - foreign):  # the mark of a deletion that ended, or of a name since reused
        mark = deletion_mark(tag)
        if modified_or_now(storage, mark) < cutoff:
            report.bookkeeping.append(mark)
            if not dry_run:
                storage.delete(mark)
    _collect_root_leftovers(storage, cutoff, report)
    for key, upload_id, started in uploads:
        if key.split("/", 1)[0] not in ours:
            report.kept_uploads.append(key)
        else:
            abort_if_old(key, upload_id, started)
    if report.kept_uploads:
        logger.info("gc %s: %d multipart upload(s) outside async_ckpt's tag folders kept: %s", storage.url,
                    len(report.kept_uploads), report.kept_uploads)
    logger.info("gc %s%s: %d incomplete tag(s), %d corrupt tag(s), %d partial file(s), %d bookkeeping leftover(s), "
                "%d upload(s)", storage.url, " (dry run)" if dry_run else "", len(report.incomplete_tags),
                len(report.corrupt_tags), len(report.partial_files),
                len(report.bookkeeping), len(report.aborted_uploads))
    return report
