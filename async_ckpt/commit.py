"""Commit: a tag becomes visible only once every rank's files are durable.

Ranks coordinate through the storage itself, never through the training process group (a
collective from a background thread deadlocks against the training loop's own collectives):

1. each rank, once its files are durable, publishes ``{tag}/.async_ckpt/{save_id}/rank-N.json``
   listing its files (or ``rank-N.failed.json`` with the cause);
2. rank 0 waits for all markers, then writes the tokenizer, the recovery scripts, the manifest
   (the commit record) and, last, ``latest`` — each one atomically;
3. the other ranks wait for that manifest (or any failure marker) to learn the outcome.

The ``save_id`` is fresh for every save, so markers left by an earlier attempt at the same tag
can never complete a later one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Callable

import deepspeed

from async_ckpt.catalog import list_tags, read_latest
from async_ckpt.errors import SaveFailedError
from async_ckpt.job import SaveJob
from async_ckpt.layout import LATEST, RECOVERY_SCRIPTS, manifest_path, marker_prefix, rank_marker
from async_ckpt.manifest import FileEntry, Manifest, decode_entries, encode_entries
from async_ckpt.serialization import copy_local_file
from async_ckpt.storage.base import Storage

logger = logging.getLogger("async_ckpt")

_POLL_START_S = 0.01
_POLL_MAX_S = 0.5


def publish_rank(job: SaveJob, entries: list[FileEntry]) -> None:
    job.storage.write_bytes(rank_marker(job.tag, job.save_id, job.rank), encode_entries(entries))


def publish_failure(job: SaveJob, exc: BaseException) -> None:
    """Best effort: tell the other ranks this tag failed here, so they fail it too."""
    payload = json.dumps({"rank": job.rank, "error": f"{type(exc).__name__}: {exc}"}).encode()
    try:
        job.storage.write_bytes(rank_marker(job.tag, job.save_id, job.rank, failed=True), payload)
    except Exception as marker_exc:  # the storage itself may be what failed
        logger.debug("could not publish the failure marker of tag %s: %s", job.tag, marker_exc)


def _poll(deadline: float, check: Callable[[], object | None], what: str) -> object:
    delay = _POLL_START_S
    while True:
        outcome = check()
        if outcome is not None:
            return outcome
        if time.monotonic() > deadline:
            raise SaveFailedError(what)
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


def _failure_in(job: SaveJob, names: list[str]) -> SaveFailedError | None:
    for name in names:
        if name.endswith(".failed.json"):
            path = f"{marker_prefix(job.tag, job.save_id)}/{name}"
            try:
                detail = json.loads(job.storage.read_bytes(path))
                cause = f"rank {detail['rank']}: {detail['error']}"
            except Exception:
                cause = name
            return SaveFailedError(f"tag {job.tag!r} failed on {cause}", tag=job.tag)
    return None


def await_commit(job: SaveJob, timeout_s: float) -> Manifest:
    """Block until the tag is committed (rank 0 commits it) or failed anywhere."""
    if job.rank == 0:
        return _gather_and_commit(job, timeout_s)
    return _await_manifest(job, 2 * timeout_s)


def _gather_and_commit(job: SaveJob, timeout_s: float) -> Manifest:
    prefix = marker_prefix(job.tag, job.save_id)
    expected = {f"rank-{r:05d}.json" for r in range(job.world_size)}

    def check() -> list[str] | None:
        names = job.storage.list_dir(prefix)
        failure = _failure_in(job, names)
        if failure is not None:
            raise failure
        return names if expected.issubset(names) else None

    missing_msg = (f"tag {job.tag!r}: not every rank finished writing within {timeout_s:.0f} s "
                   "(a rank crashed or its storage stalled); raise commit_timeout_s if writes are slow")
    _poll(time.monotonic() + timeout_s, check, missing_msg)
    entries: list[FileEntry] = []
    for rank in range(job.world_size):
        entries.extend(decode_entries(job.storage.read_bytes(rank_marker(job.tag, job.save_id, rank))))
    return _commit(job, entries)


def _commit(job: SaveJob, entries: list[FileEntry]) -> Manifest:
    started = time.perf_counter()
    storage = job.storage
    if job.extras_dir:
        for root, _, names in os.walk(job.extras_dir):
            for name in sorted(names):
                local = os.path.join(root, name)
                rel = os.path.relpath(local, job.extras_dir).replace(os.sep, "/")
                entries.append(copy_local_file(storage, f"{job.tag}/{rel}", local, tag_dir=job.tag, rank=0))
        shutil.rmtree(job.extras_dir, ignore_errors=True)
    scripts_dir = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
    for script in RECOVERY_SCRIPTS:
        with open(os.path.join(scripts_dir, script), "rb") as fh:
            storage.write_bytes(script, fh.read())
        local_root = storage.local_dir()
        if local_root:
            path = os.path.join(local_root, script)
            os.chmod(path, os.stat(path).st_mode | 0o111)
    manifest = Manifest(
        tag=job.tag,
        step=int(job.metadata.get("step", 0)),
        world_size=job.world_size,
        zero_stage=int(job.metadata.get("zero_stage", 0)),
        dtype=str(job.metadata.get("dtype", "fp32")),
        files=sorted(entries, key=lambda e: e.path),
        versions=dict(job.metadata.get("versions", {})),
        timings={k: round(float(v), 6) for k, v in job.handle.metrics.items() if k.endswith("_s")},
        created_unix=time.time(),
        save_id=job.save_id,
    )
    storage.write_bytes(manifest_path(job.tag), manifest.to_json())
    if job.save_latest:
        storage.write_bytes(LATEST, job.tag.encode())
    job.handle.metrics["commit_s"] = time.perf_counter() - started
    try:
        storage.delete(marker_prefix(job.tag, job.save_id).rsplit("/", 1)[0], recursive=True)
    except Exception as exc:
        logger.debug("could not remove commit markers of %s: %s", job.tag, exc)
    if job.keep_last:
        apply_retention(storage, job.tag, job.keep_last, job.keep_every)
    return manifest


def _await_manifest(job: SaveJob, timeout_s: float) -> Manifest:
    prefix = marker_prefix(job.tag, job.save_id)

    def check() -> Manifest | None:
        failure = _failure_in(job, job.storage.list_dir(prefix))
        if failure is not None:
            raise failure
        try:
            manifest = Manifest.from_json(job.storage.read_bytes(manifest_path(job.tag)))
        except FileNotFoundError:
            return None
        return manifest if manifest.save_id == job.save_id else None

    return _poll(time.monotonic() + timeout_s, check,
                 f"tag {job.tag!r}: rank 0 did not commit within {timeout_s:.0f} s")  # type: ignore[return-value]


def apply_retention(storage: Storage, current: str, keep_last: int, keep_every: int | None = None) -> list[str]:
    """Delete the oldest committed tags beyond ``keep_last``; return what was deleted.

    Runs only after a newer commit succeeded. Never deletes the tag just committed, the one
    ``latest`` names, or (with ``keep_every``) a tag whose step is a multiple of ``keep_every``.
    """
    committed = [t for t in list_tags(storage) if t.committed and not t.manifest.universal]  # conversions are kept
    protected = {current, read_latest(storage)}
    deleted = []
    for info in committed[:-keep_last] if len(committed) > keep_last else []:
        if info.tag in protected or (keep_every and info.manifest.step % keep_every == 0):
            continue
        logger.info("retention: deleting committed tag %s (keep_last=%d)", info.tag, keep_last)
        storage.delete(manifest_path(info.tag))  # uncommit first: a half-deleted tag is never 'committed'
        storage.delete(info.tag, recursive=True)
        deleted.append(info.tag)
    return deleted
