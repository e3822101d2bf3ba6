"""Commit: a tag becomes visible only once every rank's files are durable, and once visible it stays whole.

The ranks agree through the job's c10d store (:mod:`async_ckpt.handshake`), never through the
training process group and never by polling the storage:

0. each rank, before its first file of the tag, writes its start mark (:func:`mark_started`), so that
   ``async-ckpt gc`` can tell a save of ours that died from any other folder without a manifest;
1. each rank, once its files are durable, reports their sizes and CRC-32s (or its failure);
2. rank 0 waits for every report, writes the tokenizer and DeepSpeed's recovery scripts, takes the
   ``commit`` decision and writes the manifest: the tag is committed exactly when the manifest exists;
3. after the manifest rank 0 writes ``latest``, removes the start marks and applies retention. These may fail without
   un-committing anything: the save is reported committed, with a warning naming what failed;
4. rank 0 publishes the outcome, which the other ranks wait for.

No rank deletes files of a tag that may still commit. A rank deletes its own files of a failed tag
only when the outcome says no manifest can appear (the ``abort`` decision was taken); otherwise,
e.g. after the job's store went away, the files stay and ``async-ckpt gc`` removes them once the
grace period has passed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import replace
from typing import Callable, ContextManager, Iterator

from async_ckpt.catalog import list_tags, read_latest, read_manifest
from async_ckpt.handshake import ABORT, COMMIT, HandshakeFailed, HandshakeTimeout, Outcome
from async_ckpt.job import SaveJob
from async_ckpt.layout import (LATEST, MARKER_DIR, MARKS_LOCK, deletion_mark, installed_recovery_scripts,
                               manifest_path, start_mark)
from async_ckpt.manifest import FileEntry, Manifest
from async_ckpt.serialization import copy_local_file
from async_ckpt.storage.base import Storage
from async_ckpt.storage.local import file_lock

logger = logging.getLogger("async_ckpt")

#: How much longer than its timeout a rank waits for the outcome once rank 0 has decided to commit (its
#: manifest and ``latest`` writes remain), before it asks the storage. Within the 400 s that
#: ``wait_timeout_s``'s default adds to twice ``commit_timeout_s``.
COMMIT_GRACE_S = 300.0


def mark_started(storage: Storage, tag: str, rank: int, save_id: str) -> None:
    """This rank is about to write its first file of ``tag``: its start mark first (a small durable file).

    gc removes a folder without a manifest only if it holds a start mark: without one, the folder may
    be a checkpoint stock DeepSpeed wrote, which has no manifest either. The marks go with the tag's
    bookkeeping folder once it commits (:func:`remove_bookkeeping`; on a node tier each rank removes
    its own), and each with its rank's files if the tag aborts (:func:`unmark`), except where the rank's
    own write was cut short: what that left may be out of its cleanup's sight, so gc gets the folder.

    In a node folder the mark is written under the folder's marks lock, shared (:func:`no_new_marks`).
    """
    with _marks_lock(storage, shared=True):
        storage.write_bytes(start_mark(tag, rank), save_id.encode())


def add_marks_lock(storage: Storage) -> None:
    """Give a local folder (a node's, of the local tier) the lock by which start marks wait for a
    deletion that looks for them (:func:`no_new_marks`). Every rank of the node calls it before its first
    save there; folders without the lock file (a local URL, object storage) take no lock."""
    with _marks_lock(storage, shared=True, create=True):
        pass


@contextlib.contextmanager
def no_new_marks(storage: Storage, *, create: bool = True) -> Iterator[None]:
    """Hold off start marks in the node folder ``storage`` for the block (its lock, :func:`add_marks_lock`;
    made again if the folder was wiped, unless ``create`` is false: gc adds none to a folder without one).

    Local retention checks a tag for another save's start mark, then deletes it. An overwrite's first
    mark written in between would be deleted with the tag, and the new files after it written into a
    folder with no manifest and no mark. Under this lock a mark lands before the check or after the
    deletion (into a fresh folder). gc holds it the same way. Where the folder has no lock file (a local
    URL, object storage) or the filesystem refuses locks, that window stays open."""
    with _marks_lock(storage, shared=False, create=create):
        yield


def _marks_lock(storage: Storage, *, shared: bool, create: bool = False) -> ContextManager[bool]:
    folder = storage.local_dir()
    if folder is None:
        return contextlib.nullcontext(False)
    return file_lock(os.path.join(folder, *MARKS_LOCK.split("/")), shared=shared, create=create)


def unmark(storage: Storage, tag: str, rank: int) -> None:
    """Remove this rank's start mark (a missing mark is fine): of an aborted tag once its files are gone,
    or of a tag committed on a node tier, where each rank removes its own, never a later save's."""
    storage.delete(start_mark(tag, rank))


def delete_tag(storage: Storage, tag: str) -> None:
    """The one way a tag is deleted (retention, local-tier pruning, gc): its deletion mark, then the
    manifest (uncommitted first: a half-deleted tag is never 'committed'), the folder, and the mark.
    A deletion cut short leaves the mark, by which gc knows the rest of the folder for ours."""
    storage.write_bytes(deletion_mark(tag), b"")
    storage.delete(manifest_path(tag))
    storage.delete(tag, recursive=True)
    storage.delete(deletion_mark(tag))


def remove_files(storage: Storage, tag: str, entries: list[FileEntry]) -> bool:
    """Delete these files of an aborted ``tag``; return whether all of them went (failures are logged)."""
    removed = True
    for entry in entries:
        try:
            storage.delete(f"{tag}/{entry.path}")
        except Exception as exc:
            removed = False
            logger.debug("could not remove %s/%s: %s", tag, entry.path, exc)
    return removed


def remove_bookkeeping(storage: Storage, tag: str) -> None:
    """After the manifest: the tag's ``.async_ckpt/`` folder (start marks, byte-exact scratch) goes, so a
    committed tag holds DeepSpeed's files and the manifest only. Failing is harmless (logged): gc removes
    the folder once it is older than its grace period."""
    try:
        storage.delete(f"{tag}/{MARKER_DIR}", recursive=True)
    except Exception as exc:
        logger.debug("could not remove %s/%s at %s: %s", tag, MARKER_DIR, storage.url, exc)


def report_failure(job: SaveJob, error: str) -> None:
    """This rank could not write its files: fail the tag on every rank.

    Rank 0 decides ``abort`` and publishes the outcome at once; another rank's report wakes rank 0,
    which then does the same. Either way no manifest can appear, so this rank may delete its files.
    """
    job.handshake.report(error=error)
    if job.rank == 0:
        _publish(job, _abort(job, f"rank 0: {error}"))


def commit(job: SaveJob, entries: list[FileEntry], timeout_s: float) -> Outcome:
    """This rank's files are durable: take part in the commit and return the outcome all ranks agree on."""
    job.handshake.report(entries=entries)
    if job.rank != 0:
        outcome = _await_outcome(job, 2 * timeout_s)  # rank 0 waits up to timeout_s for the others, then commits
        node_committed = True
        if outcome.committed and job.tier_leader and outcome.manifest:
            node_manifest = replace(Manifest.from_json(outcome.manifest).one_copy_each(job.node_ranks),
                                    node_ranks=sorted(job.node_ranks))
            warnings = _commit_node_tier(job, node_manifest.to_json())
            node_committed = not warnings
            outcome.warnings.extend(warnings)
        # on a node tier each rank removes its own mark; the leader's stays until the node's manifest is written
        if outcome.committed and job.tiered and node_committed:
            try:
                unmark(job.storage, job.tag, job.rank)
            except Exception as exc:
                logger.debug("could not remove the start mark of %s on %s: %s", job.tag, job.storage.url, exc)
        return outcome
    metrics, waiting = job.handle.metrics, time.perf_counter()
    try:
        entries = job.handshake.gather(timeout_s)
    except HandshakeFailed as exc:
        return _publish(job, _abort(job, f"tag {job.tag!r} failed on {exc}"))
    extras = time.perf_counter()
    metrics["ranks_wait_s"] = extras - waiting
    extra_entries: list[FileEntry] = []
    try:
        _write_extras(job, extra_entries)
        metrics["extras_s"] = time.perf_counter() - extras
    except Exception as exc:
        job.keep_mark = True  # the write cut short may have left what its cleanup cannot see
        aborted = _abort(job, f"rank 0 could not write the tokenizer or DeepSpeed's recovery scripts: "
                              f"{type(exc).__name__}: {exc}")
        aborted.cleanup = remove_files(job.storage, job.tag, extra_entries)  # else every file stays for gc
        return _publish(job, aborted)
    entries += extra_entries
    if job.handshake.decide(COMMIT) != COMMIT:
        return _publish(job, Outcome(False, f"tag {job.tag!r}: a rank gave up waiting before rank 0 could commit "
                                            "(raise commit_timeout_s if the writes are this slow)",
                                     cleanup=remove_files(job.storage, job.tag, extra_entries)))
    started = time.perf_counter()
    everything = _manifest(job, entries)  # every rank's copies: a tiered save publishes them all
    manifest = everything.one_copy_each()
    if job.tiered:  # written into rank 0's node folder, which holds its node's files only
        manifest = replace(manifest, node_ranks=sorted(job.node_ranks))
    try:
        job.storage.write_bytes(manifest_path(job.tag), manifest.to_json())
    except Exception as exc:
        if not _committed(job):
            return _publish(job, Outcome(False, f"tag {job.tag!r}: rank 0 could not write the manifest: "
                                                f"{type(exc).__name__}: {exc}. The tag's files stay for "
                                                "`async-ckpt gc`"))
    after = time.perf_counter()
    metrics["commit_s"] = after - started
    outcome = Outcome(True, warnings=_after_commit(job, manifest),
                      manifest=everything.to_json().decode() if job.tiered else None)
    metrics["after_commit_s"] = time.perf_counter() - after
    return _publish(job, outcome)


def _commit_node_tier(job: SaveJob, manifest: bytes) -> list[str]:
    """Commit the tag on this node's own local tier, which rank 0 cannot see: DeepSpeed's recovery
    scripts, the manifest rank 0 published, then ``latest``. Rank 0's commit holds regardless: if this
    fails before the manifest, this node's ranks restart from the durable tier; after it, from this
    tier too (``load()`` goes by manifests, not by ``latest``)."""
    try:
        _write_recovery_scripts(job.storage)
        job.storage.write_bytes(manifest_path(job.tag), manifest)
        if job.save_latest:
            job.storage.write_bytes(LATEST, job.tag.encode())
    except Exception as exc:
        warning = (f"rank {job.rank} could not commit it on its node's tier {job.storage.url} ({type(exc).__name__}: "
                   f"{exc}); that node's ranks restart from the durable tier unless its manifest is there")
        logger.warning("tag %s is committed, but %s", job.tag, warning)
        return [warning]
    return []


def _abort(job: SaveJob, error: str) -> Outcome:
    """Rank 0 gives the tag up (only rank 0 ever decides ``commit``, so ``abort`` holds)."""
    job.handshake.decide(ABORT)
    return Outcome(False, error, cleanup=True)


def _publish(job: SaveJob, outcome: Outcome) -> Outcome:
    try:
        job.handshake.publish(outcome)
    except Exception as exc:  # the job's store is gone: the other ranks time out and check the manifest
        logger.warning("rank 0 could not publish the outcome of tag %s to the other ranks: %s", job.tag, exc)
    return outcome


def _await_outcome(job: SaveJob, timeout_s: float) -> Outcome:
    """Rank 0's verdict. If it does not come in time, abort the tag, unless rank 0 already decided to
    commit it: then wait up to :data:`COMMIT_GRACE_S` more for the outcome, and failing that, ask the
    storage. So a rank waits at most ``timeout_s + COMMIT_GRACE_S``, within ``wait_timeout_s``'s default."""
    try:
        return job.handshake.await_outcome(timeout_s)
    except HandshakeTimeout as exc:
        waited = str(exc)
    try:
        decision = job.handshake.decide(ABORT)
    except Exception:  # the store is gone: only the storage can tell
        decision = None
    if decision == ABORT:
        return Outcome(False, f"tag {job.tag!r}: rank {job.rank} gave up: {waited}", cleanup=True)
    if decision == COMMIT:  # rank 0's manifest and 'latest' writes remain; past the grace, the storage tells
        grace = min(timeout_s, COMMIT_GRACE_S)
        logger.warning("rank %d: %s, but rank 0 is committing tag %s; waiting up to %.0f s more", job.rank, waited,
                       job.tag, grace)
        try:
            return job.handshake.await_outcome(grace)
        except HandshakeTimeout as exc:
            waited = str(exc)
    if _committed(job):
        return Outcome(True, warnings=[f"rank {job.rank} did not hear rank 0's outcome ({waited}); "
                                       "the manifest shows the tag committed"])
    return Outcome(False, f"tag {job.tag!r}: rank {job.rank} did not learn the outcome ({waited}) and no manifest "
                          "exists yet; this rank's files stay for `async-ckpt gc`")


def _committed(job: SaveJob) -> bool:
    """Whether this save's manifest exists (one read): the ground truth when the store cannot answer."""
    try:
        manifest = read_manifest(job.storage, job.tag)
    except Exception as exc:
        logger.warning("rank %d could not read the manifest of tag %s: %s", job.rank, job.tag, exc)
        return False
    return manifest is not None and manifest.save_id == job.save_id


def _write_extras(job: SaveJob, entries: list[FileEntry]) -> None:
    """Rank 0's tokenizer and model config into the tag, DeepSpeed's recovery scripts into the root
    (not for a consolidated save: it has no ZeRO shards to recover). ``entries`` gets each file as it
    is written, so that an abort, even one this raises, can remove them."""
    storage = job.storage
    if job.extras_dir:
        if not os.path.isdir(job.extras_dir):  # os.walk would yield nothing: a tag without its tokenizer
            raise FileNotFoundError(f"the save's tokenizer and model config in {job.extras_dir} are gone")
        for root, _, names in os.walk(job.extras_dir):
            for name in sorted(names):
                local = os.path.join(root, name)
                rel = os.path.relpath(local, job.extras_dir).replace(os.sep, "/")
                entries.append(copy_local_file(storage, f"{job.tag}/{rel}", local, tag_dir=job.tag, rank=0))
        shutil.rmtree(job.extras_dir, ignore_errors=True)
    if not job.consolidated:
        _write_recovery_scripts(storage)


def _write_recovery_scripts(storage: Storage) -> None:
    """DeepSpeed's ``zero_to_fp32.py`` (and ``zero_to_torch.py``) into the root, executable as DeepSpeed
    leaves them; skipped where the root already holds the same bytes (every save after the first):
    reading them back costs under a millisecond, while durable writes on a disk that training's saves
    keep busy made rank 0's extras step (these and the model config) 29-70 ms per save."""
    for script, path in installed_recovery_scripts().items():
        with open(path, "rb") as fh:
            data = fh.read()
        if not (storage.exists(script) and storage.read_bytes(script) == data):
            storage.write_bytes(script, data)
        local_root = storage.local_dir()
        if local_root:
            _make_executable(os.path.join(local_root, script))


def _make_executable(path: str) -> None:
    """Add the execute bits DeepSpeed leaves on a recovery script. Where the filesystem refuses (SMB and
    Azure file shares, a script another user owns in a shared root) it is logged, not raised, as
    DeepSpeed does: the script still runs with ``python``, and failing the save over it would leave no
    checkpoint at all."""
    try:
        mode = os.stat(path).st_mode
        if mode & 0o111 != 0o111:
            os.chmod(path, mode | 0o111)
    except OSError as exc:
        logger.warning("could not make %s executable (%s); run it with python", path, exc)


def _manifest(job: SaveJob, entries: list[FileEntry]) -> Manifest:
    return Manifest(
        tag=job.tag,
        step=int(job.metadata.get("step", 0)),
        world_size=job.world_size,
        zero_stage=int(job.metadata.get("zero_stage", 0)),
        dtype=str(job.metadata.get("dtype", "fp32")),
        files=sorted(entries, key=lambda e: (e.path, e.rank)),
        versions=dict(job.metadata.get("versions", {})),
        timings={k: round(float(v), 6) for k, v in job.handle.metrics.items() if k.endswith("_s")},
        created_unix=float(job.metadata.get("created_unix", time.time())),  # a drain keeps its save's time
        save_id=job.save_id,
        sets_latest=job.save_latest,
        consolidated=job.consolidated,
    )


def _after_commit(job: SaveJob, manifest: Manifest) -> list[str]:
    """``latest``, bookkeeping removal and retention: each may fail; none of them un-commits the tag.
    Under the storage's :attr:`~async_ckpt.storage.base.Storage.after_commit_lock`."""
    with job.storage.after_commit_lock:
        storage, warnings = job.storage, []
        later = _later_save_named_by_latest(job, manifest)
        if later is not None:
            logger.info("tag %s reached %s after %s, a later save: 'latest' stays on %s", job.tag, storage.url, later,
                        later)
        elif job.save_latest:
            try:
                storage.write_bytes(LATEST, job.tag.encode())
            except Exception as exc:
                warnings.append(f"could not write 'latest' ({type(exc).__name__}: {exc}); load() still resumes "
                                f"from {job.tag}, the newest committed tag")
        remove_bookkeeping(storage, job.tag)
        if job.keep_last:
            try:
                apply_retention(storage, job.tag, job.keep_last, job.keep_every,
                                allowed=job.retention_allowed or always_allowed)
            except Exception as exc:
                warnings.append(f"retention (keep_last={job.keep_last}) failed ({type(exc).__name__}: {exc}); "
                                "older tags stay until the next save's retention")
        for warning in warnings:
            logger.warning("tag %s is committed, but %s", job.tag, warning)
        return warnings


def _later_save_named_by_latest(job: SaveJob, manifest: Manifest) -> str | None:
    """For a drain (a save committed on the local tier earlier, copied to the URL now): the tag ``latest``
    names at the URL if that is a later save, by save time and step as :func:`~async_ckpt.tiers.choose_tag`
    orders them; else ``None``. A save goes straight to the URL when the local tier is full, and may
    commit there while an older tag's drain still waits. A fresh save always moves ``latest``."""
    if not job.save_latest or "created_unix" not in job.metadata:
        return None
    try:
        named = read_latest(job.storage)
        other = read_manifest(job.storage, named) if named not in (None, job.tag) else None
    except Exception as exc:  # an unreadable 'latest' or manifest is replaced, as without a drain
        logger.debug("could not read what 'latest' names at %s: %s", job.storage.url, exc)
        return None
    if other is None or other.recency <= manifest.recency:
        return None
    return named


def _still_committed(storage: Storage, listed: Manifest) -> bool:
    """Whether the tag of ``listed`` still holds that save's manifest: a save that overwrites the tag (on
    rank 0's training thread, and another rank's writer) may have uncommitted it since the listing, and
    committed its own files, which retention must not delete."""
    try:
        now = read_manifest(storage, listed.tag)
    except Exception as exc:  # unreadable now: left for a later pass to judge
        logger.info("retention: leaving %s at %s, whose manifest cannot be read now (%s)", listed.tag, storage.url,
                    exc)
        return False
    if now is None or now.save_id != listed.save_id:
        logger.info("retention: leaving %s at %s, saved again since it was listed", listed.tag, storage.url)
        return False
    return True


def always_allowed() -> ContextManager[bool]:
    """The retention guard of a pass that nothing pauses."""
    return contextlib.nullcontext(True)


def apply_retention(storage: Storage, current: str, keep_last: int, keep_every: int | None = None, *,
                    allowed: Callable[[], ContextManager[bool]] = always_allowed) -> list[str]:
    """Delete the oldest committed tags beyond ``keep_last``; return what was deleted.

    Runs only after a newer commit succeeded. Never deletes the tag just committed, the one
    ``latest`` names, or (with ``keep_every``) a tag whose step is a multiple of ``keep_every``.
    Each deletion runs inside ``allowed()``, and only where it yields true; where it yields false the
    pass ends there (a load may read the tags: a later commit's pass deletes what this one left).
    """
    committed = [t for t in list_tags(storage) if t.is_checkpoint()]  # conversions and consolidated saves are kept
    protected = {current, read_latest(storage)}
    deleted = []
    for info in committed[:-keep_last] if len(committed) > keep_last else []:
        if info.tag in protected or (keep_every and info.manifest.step % keep_every == 0):
            continue
        with allowed() as may_delete:
            if not may_delete:
                logger.info("retention: leaving %s at %s while a load may read it; a later commit deletes it",
                            info.tag, storage.url)
                break
            if not _still_committed(storage, info.manifest):
                continue
            logger.info("retention: deleting committed tag %s (keep_last=%d)", info.tag, keep_last)
            delete_tag(storage, info.tag)
        deleted.append(info.tag)
    return deleted
