"""Pull: copy a committed tag from any storage into a local folder, verified and resumable.

DeepSpeed's ``load_checkpoint``, ``zero_to_fp32.py`` and ``ds_to_universal.py`` only read local
folders, so every path from object storage back into DeepSpeed goes through here: resume fetches
the files one rank reads into its cache, ``async-ckpt pull`` fetches a whole tag (or one rank's
share) into a folder laid out like a stock DeepSpeed checkpoint root (``latest``, or
``latest_universal`` for a universal tag, the tag folder, ``zero_to_fp32.py``).

Every file is checked against the manifest's size and CRC-32 before it takes its final name, and
a file already present and correct is not fetched again. A pull that was interrupted picks up
where it stopped: finished files are skipped and a partly fetched file keeps the parts it has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

from async_ckpt.catalog import list_tags
from async_ckpt.errors import (CorruptManifestError, MissingFileError, StorageError, UnsupportedManifestError,
                               UsageError, VerificationError)
from async_ckpt.layout import (LATEST, LATEST_UNIVERSAL, MANIFEST, RECOVERY_SCRIPTS, files_for_rank,
                               installed_recovery_scripts, is_deepspeed_shard, manifest_path, model_parallel_size)
from async_ckpt.manifest import FileEntry, Manifest
from async_ckpt.storage.base import Progress, Storage
from async_ckpt.storage.local import LocalStorage, file_lock, fsync_path, make_folders
from async_ckpt.verify import check_local_file

logger = logging.getLogger("async_ckpt")


@dataclass
class PullReport:
    """What a pull (or a resume's fetch) moved."""

    tag: str
    dest: str
    files_fetched: int = 0
    files_skipped: int = 0
    bytes_fetched: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)


#: Beside the tag folder, not in it: DeepSpeed's tools walk the tag folder and take every file whose name
#: starts with ``zero_pp_rank_`` (ds_to_universal under ZeRO-2), lock files included.
_LOCKS_DIR = ".async_ckpt-fetching"


@contextlib.contextmanager
def _fetching(tag_dir: str, path: str) -> Iterator[bool]:
    """An exclusive lock on fetching ``path`` into ``tag_dir`` (resume's cache, or a pull's destination): the
    ranks of a node that share a cache and need the same file (every rank's model states under ZeRO-1/2)
    fetch it once; the others wait, then find it cached. Pulls of the ranks into one destination, which
    share one partial file per file, likewise. Where the filesystem refuses locks, each fetches its own
    copy as before. The lock file, and its folders once empty, are removed with the lock."""
    parent, tag = os.path.split(os.path.normpath(tag_dir))
    locks = os.path.join(parent, _LOCKS_DIR, tag)
    with file_lock(os.path.join(locks, f"fetching-{path.replace('/', '__')}.lock"), remove=True) as held:
        yield held
    for folder in (locks, os.path.dirname(locks)):
        try:
            os.rmdir(folder)
        except OSError:  # another fetch's lock is in it, or it is gone already
            return


def download(storage: Storage, manifest: Manifest, entries: list[FileEntry], tag_dir: str, *,
             max_concurrency: int, resumable: bool, progress: Progress | None = None,
             before_replacing: Callable[[], None] | None = None) -> PullReport:
    """Fetch ``entries`` of ``manifest`` into ``tag_dir``, verified; skip files already correct there.

    ``resumable`` keeps partial files under a stable name for the next attempt. Without it (resume's
    cache, which the ranks of a node may share) each fetch uses a temporary name of its own, and a
    file is fetched by one process at a time (:func:`_fetching`): the others then find it cached.
    ``before_replacing`` is called once, before the first fetched file takes its name. A resumable
    fetch (a pull, which stock DeepSpeed then reads unverified) is made durable before it takes its
    name; resume's cache is verified at every load instead.
    """
    started = time.perf_counter()
    report = PullReport(tag=manifest.tag, dest=tag_dir, files=[e.path for e in entries])
    first_replace = threading.Lock()
    replaced = threading.Event()

    def replace(tmp: str, dest: str) -> None:
        if before_replacing is not None and not replaced.is_set():
            with first_replace:
                if not replaced.is_set():
                    before_replacing()
                    replaced.set()
        if resumable:
            fsync_path(tmp)
        os.replace(tmp, dest)
        if resumable:
            fsync_path(os.path.dirname(dest))

    def fetch(entry: FileEntry) -> int:
        dest = os.path.join(tag_dir, *entry.path.split("/"))
        # a file takes its name only once verified (os.replace below), so one that exists needs no lock to check,
        # unless the fetch is resumable: its partial file's name is the same in every process
        if os.path.exists(dest) and not resumable:
            return fetch_unless_cached(entry, dest)
        with _fetching(tag_dir, entry.path):
            return fetch_unless_cached(entry, dest)

    def fetch_unless_cached(entry: FileEntry, dest: str) -> int:
        if check_local_file(dest, entry).ok:
            if progress:
                progress(entry.size)
            return -1
        make_folders(os.path.dirname(dest), fsync=resumable)
        # a name of its own per fetch: ranks of a node, or nodes sharing a cache_dir, may fetch one file at once
        tmp = f"{dest}.partial" if resumable else f"{dest}.{uuid.uuid4().hex}.partial"
        resumed = resumable and os.path.exists(tmp)
        fetch_into(entry, tmp, resume=resumable, progress=progress)
        check = check_local_file(tmp, entry)
        if not check.ok and resumed:  # what an earlier pull kept may be of another save of the tag, since overwritten
            logger.info("%s/%s: the part an earlier pull kept does not match (%s); fetching it whole", manifest.tag,
                        entry.path, check.problem)
            os.unlink(tmp)
            fetch_into(entry, tmp, resume=False, progress=None)  # the bar counted this file whole already
            check = check_local_file(tmp, entry)
        if not check.ok:
            os.unlink(tmp)
            raise VerificationError(f"{storage.url}/{manifest.tag}/{entry.path}: {check.problem}; the stored "
                                    "file is corrupt or was changed after the commit")
        replace(tmp, dest)
        return entry.size

    def fetch_into(entry: FileEntry, tmp: str, *, resume: bool, progress: Progress | None) -> None:
        try:
            storage.get_file(f"{manifest.tag}/{entry.path}", tmp, progress=progress, resume=resume)
        except BaseException as exc:
            if not resumable:  # nobody will resume it
                for leftover in (tmp, f"{tmp}.parts"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(leftover)
            if isinstance(exc, MissingFileError):  # a committed file gone from storage: as unreadable as a corrupt one
                raise VerificationError(f"{storage.url}/{manifest.tag}/{entry.path}: missing from storage; it was "
                                        "deleted after the commit") from exc
            raise

    with ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="async_ckpt-fetch") as pool:
        for nbytes in pool.map(fetch, entries):
            if nbytes < 0:
                report.files_skipped += 1
            else:
                report.files_fetched += 1
                report.bytes_fetched += nbytes
    report.seconds = time.perf_counter() - started
    return report


def pull(storage: Storage, manifest: Manifest, dest: str, *, rank: int | None = None,
         max_concurrency: int = 8, show_progress: bool = True) -> PullReport:
    """Copy the committed tag of ``manifest`` into ``dest`` as a DeepSpeed checkpoint root.

    With ``rank``, only the files that data-parallel rank reads (plus the small non-tensor files:
    tokenizer, config) are fetched: enough for that rank's ``load_checkpoint``.
    """
    local = storage.local_dir()
    if not dest.strip():
        raise UsageError("--dest is empty; pass the local folder to pull the tag into")
    dest = os.path.expanduser(dest)  # as LocalStorage takes it, which writes the manifest and 'latest'
    if local is not None and os.path.realpath(local) == os.path.realpath(dest):
        raise UsageError(f"--dest {dest} is the checkpoint root itself; pull into another folder")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise UsageError(f"--dest {dest} is a file; pull into a folder")
    paths = [f.path for f in manifest.files]
    tag_dir = os.path.join(dest, manifest.tag)
    others = files_of_another_save(tag_dir, paths)
    if others:
        raise UsageError(f"{tag_dir} holds files that tag {manifest.tag!r} at {storage.url} does not list "
                         f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): another save of that tag, "
                         "whose files DeepSpeed's tools would read with these. Pull into another --dest, or remove "
                         "that folder first")
    if rank is not None:
        dp_size = manifest.world_size // model_parallel_size(paths)
        if not 0 <= rank < dp_size:
            raise UsageError(f"data-parallel rank {rank} does not exist in tag {manifest.tag!r}, saved by "
                             f"{dp_size} data-parallel rank(s) of {manifest.world_size}; pass --rank 0..{dp_size - 1}")
        held = _held_manifest(tag_dir)
        if held is not None and held.save_id != manifest.save_id:
            raise UsageError(f"{tag_dir} holds a pull of another save of tag {manifest.tag!r}: a pull of rank {rank} "
                             "alone would label that save's files of the other ranks with this save's manifest. "
                             "Pull into another --dest, remove that folder first, or pull every rank (no --rank)")
        keep = set(files_for_rank(paths, rank)) | {p for p in paths if not p.endswith(".pt")}
        paths = [p for p in paths if p in keep]
    entries = [manifest.entry(p) for p in paths]
    make_folders(tag_dir)
    total = sum(e.size for e in entries)
    bar = _ProgressBar(total, f"pull {manifest.tag}", show_progress)
    try:
        report = download(storage, manifest, entries, tag_dir, max_concurrency=max_concurrency, resumable=True,
                          progress=bar, before_replacing=lambda: _unlabel_another_save(dest, tag_dir, manifest))
    finally:
        bar.close()
    report.dest = dest
    out = LocalStorage(dest, direct_io=False)  # each file written whole, durable, then named
    out.write_bytes(f"{manifest.tag}/{MANIFEST}", _stored_manifest(storage, manifest))
    for script in RECOVERY_SCRIPTS:
        content = _recovery_script(storage, script)
        if content is None:
            continue
        out.write_bytes(script, content)
        os.chmod(os.path.join(dest, script), 0o755)
    out.write_bytes(LATEST_UNIVERSAL if manifest.universal else LATEST, manifest.tag.encode())
    _warn_of_newer_tags(out, manifest)
    logger.info("pulled %s from %s into %s: %d file(s), %.3f GB fetched, %d already there, %.2f s",
                manifest.tag, storage.url, dest, report.files_fetched, report.bytes_fetched / 1e9,
                report.files_skipped, report.seconds)
    return report


def _warn_of_newer_tags(out: LocalStorage, manifest: Manifest) -> None:
    """Stock DeepSpeed loads the tag ``latest`` names; async_ckpt's ``load()`` without a tag takes a newer
    committed one that moved ``latest`` (see :func:`async_ckpt.resume.resolve`): say so where a pull of an
    older tag (a rollback) leaves the two disagreeing."""
    newer = [info.tag for info in list_tags(out) if info.is_checkpoint(universal=manifest.universal)
             and info.manifest.sets_latest and info.manifest.recency > manifest.recency]
    if newer:
        logger.warning("%s also holds %s, saved after %s: stock DeepSpeed loads %s ('latest' names it), but "
                       "async_ckpt's load() without a tag takes %s. Pass tag=%r to load(), or pull into another "
                       "--dest", out.url, ", ".join(newer), manifest.tag, manifest.tag, newer[-1], manifest.tag)


def local_view(storage: Storage, manifest: Manifest, scratch: str, *, show_progress: bool = True) -> str:
    """A local root whose ``<tag>`` folder holds exactly ``manifest``'s files: for DeepSpeed's offline tools
    (``zero_to_fp32``, ``ds_to_universal``), which take every file of the tag folder whose name matches.

    From a remote storage the files are pulled into ``scratch``. A local root's tag folder may hold more
    than its manifest lists (a ``.partial`` file a killed save left, shards of an earlier, larger save of a
    tag written again with ``overwrite_tags``), which the tools would read as part of the checkpoint: the
    view is then hard links to the listed files (symbolic links across filesystems), no copy. Each file is
    checked against its manifest entry first, as a pull checks what it fetches: the tools would convert a
    damaged file without a word, and their output be committed with checksums of its own."""
    root = storage.local_dir()
    view = os.path.join(scratch, "in")
    if root is None:
        pull(storage, manifest, view, show_progress=show_progress)
        return view
    bar = _ProgressBar(manifest.total_bytes, f"verify {manifest.tag}", show_progress)
    try:
        for entry in manifest.files:
            source = os.path.join(root, manifest.tag, *entry.path.split("/"))
            check = check_local_file(source, entry)
            bar(entry.size)
            if check.problem == "missing":
                raise MissingFileError(f"{entry.path} of tag {manifest.tag!r} is missing from {root}: run "
                                       f"`async-ckpt verify {root} --tag {manifest.tag}`")
            if not check.ok:
                raise VerificationError(f"{entry.path} of tag {manifest.tag!r} in {root} does not match its manifest "
                                        f"({check.problem}): run `async-ckpt verify {root} --tag {manifest.tag}`, "
                                        "and convert another tag")
            target = os.path.join(view, manifest.tag, *entry.path.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                os.link(source, target)
            except OSError:  # another filesystem, or one without hard links
                os.symlink(source, target)
    finally:
        bar.close()
    return view


def _stored_manifest(storage: Storage, manifest: Manifest) -> bytes:
    """The tag's manifest as stored, fields this version does not know included (a later version's, which
    reads the pulled copy too), provided it is still the save whose files were pulled; this version's
    rendering of it where the tag is gone from storage since (deleted by retention, say: the files pulled
    are the committed ones, verified)."""
    try:
        raw = storage.read_bytes(manifest_path(manifest.tag))
    except FileNotFoundError:
        logger.info("%s at %s was deleted after its files were pulled; its manifest is written as read before",
                    manifest.tag, storage.url)
        return manifest.to_json()
    if Manifest.from_json(raw).save_id != manifest.save_id:
        raise StorageError(f"tag {manifest.tag!r} at {storage.url} was saved again while it was pulled; pull again")
    return raw


def _unlabel_another_save(dest: str, tag_dir: str, manifest: Manifest) -> None:
    """Unless the tag folder holds a pull of this very save, ``latest`` naming the tag and then an earlier
    pull's manifest of another save go before the first file is replaced (also in a stock DeepSpeed root,
    which has no manifest): a pull cut short then leaves a folder nothing names as a checkpoint, not the
    old labels on a mix of two saves' files. One that fails before replacing any file leaves the earlier
    pull as it was, labelled."""
    held = _held_manifest(tag_dir)
    if held is not None and held.save_id == manifest.save_id:
        return
    latest = os.path.join(dest, LATEST_UNIVERSAL if manifest.universal else LATEST)
    with contextlib.suppress(FileNotFoundError):  # first: a pull killed between the two leaves neither
        with open(latest) as fh:
            named = fh.read().strip()
        if named == manifest.tag:
            os.remove(latest)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(tag_dir, MANIFEST))


def _held_manifest(tag_dir: str) -> Manifest | None:
    """The manifest an earlier pull left in ``tag_dir``; ``None`` where there is none this version reads."""
    try:
        with open(os.path.join(tag_dir, MANIFEST), "rb") as fh:
            return Manifest.from_json(fh.read())
    except (FileNotFoundError, CorruptManifestError, UnsupportedManifestError):
        return None


def files_of_another_save(tag_dir: str, paths: list[str]) -> list[str]:
    """DeepSpeed's shards (``*_model_states.pt``, ``*_optim_states.pt``: what its loaders glob) already in
    ``tag_dir`` that the manifest does not list (an earlier pull's leftovers of the same file,
    ``.partial``, count as its own)."""
    listed = set(paths)
    found = []
    for folder, subfolders, names in os.walk(tag_dir):
        subfolders[:] = [s for s in subfolders if s != _LOCKS_DIR]  # where earlier versions kept them
        for name in names:
            path = os.path.relpath(os.path.join(folder, name), tag_dir).replace(os.sep, "/")
            shard = path.removesuffix(".partial")
            if shard not in listed and is_deepspeed_shard(shard):
                found.append(path)
    return sorted(found)


def _recovery_script(storage: Storage, name: str) -> bytes | None:
    """The script saved with the checkpoint, else the installed DeepSpeed's copy, else ``None``."""
    try:
        return storage.read_bytes(name)
    except FileNotFoundError:
        local = installed_recovery_scripts().get(name)
        if local is None:
            return None
        with open(local, "rb") as fh:
            return fh.read()


class _ProgressBar:
    """A thread-safe tqdm byte counter (a no-op when disabled)."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                         disable=not enabled, dynamic_ncols=True)
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self._bar.update(nbytes)

    def close(self) -> None:
        self._bar.close()
