"""What a checkpoint root holds: its tags, which of them are committed, and what ``latest`` says."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from async_ckpt.errors import CorruptManifestError, InvalidTagError, UnsupportedManifestError
from async_ckpt.layout import (LATEST, MANIFEST, MARKER_DIR, deletion_mark, is_start_mark, manifest_path,
                               validate_tag)
from async_ckpt.manifest import Manifest
from async_ckpt.storage.base import Storage


@dataclass(frozen=True)
class TagInfo:
    tag: str
    manifest: Manifest | None
    #: Why the tag's manifest could not be read (a corrupt tag: never loaded, collected by gc).
    error: str | None = None
    #: The manifest is another async_ckpt version's format: never loaded, never deleted by this version.
    unsupported: bool = False

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    def is_checkpoint(self, *, universal: bool = False) -> bool:
        """Committed, and a checkpoint of that kind (ZeRO, or universal) that resume, fallback and retention
        consider: not a consolidated save (whole-model weights, for export)."""
        return self.manifest is not None and self.manifest.universal == universal and not self.manifest.consolidated

    @property
    def state(self) -> str:
        if self.committed:
            return "committed"
        return "unsupported" if self.unsupported else "corrupt" if self.error else "incomplete"


def read_latest(storage: Storage, name: str = LATEST) -> str | None:
    """The tag ``latest`` (or ``latest_universal``, with ``name``) names; ``None`` if absent or empty."""
    try:
        text = storage.read_bytes(name).decode().strip()
    except FileNotFoundError:
        return None
    return text or None


def inspect_latest(storage: Storage, name: str = LATEST) -> tuple[str | None, str | None]:
    """``(tag latest names, None)``, or ``(None, why)`` when the file exists but cannot be read.

    An unreadable ``latest`` (permissions, a folder in its place, not text) must not hide the
    committed tags: the manifests, not ``latest``, say what is committed. Errors of the whole root
    (a missing bucket, wrong credentials) still propagate.
    """
    try:
        return read_latest(storage, name), None
    except (PermissionError, IsADirectoryError, NotADirectoryError, UnicodeDecodeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def read_manifest(storage: Storage, tag: str) -> Manifest | None:
    """The tag's manifest, ``None`` if it has none; :class:`CorruptManifestError` naming the file if unreadable,
    :class:`UnsupportedManifestError` naming it if another version's.

    Its ``tag`` is the folder's name: a tag folder copied or renamed in the root (``cp -r global_step2
    best``) is checked and loaded from where it is, not from the folder it was saved as. (It counts
    toward ``keep_last`` as the save it copies: to keep one, copy it out of the root or set ``keep_every``.)"""
    try:
        raw = storage.read_bytes(manifest_path(tag))
    except FileNotFoundError:
        return None
    try:
        manifest = Manifest.from_json(raw)
    except (CorruptManifestError, UnsupportedManifestError) as exc:
        raise type(exc)(f"{storage.url}/{manifest_path(tag)}: {exc}") from exc
    return manifest if manifest.tag == tag else replace(manifest, tag=tag)


def holds_files(storage: Storage, relpath: str) -> bool:
    """Whether the folder holds a file at any depth (an aborted save of ours may leave empty folders)."""
    return next(storage.iter_files(relpath), None) is not None


def modified_or_now(storage: Storage, relpath: str) -> float:
    """A listed file's modification time; now if it is gone since the listing (renamed or removed: the
    folder is being written to, or the deletion it marked has just ended). Never old."""
    try:
        return storage.modified(relpath)
    except FileNotFoundError:
        return time.time()


def newest_mtime(storage: Storage, relpath: str) -> float:
    """The newest time of anything under ``relpath``. A folder without files yet (a save that has
    just begun) counts with its own time, or as new where the store keeps none: never as old. So does
    one where a listed file is gone by the time it is looked at (a save renamed or removed it): a
    folder being written to is new."""
    times = [modified_or_now(storage, path) for path in storage.iter_files(relpath)]
    if times:
        return max(times)
    try:
        created = storage.modified(relpath)
    except (OSError, KeyError):
        created = 0.0
    return created if created > 0 else time.time()


def has_start_mark(storage: Storage, tag: str, *, other_than: str | None = None) -> bool:
    """Whether a rank has begun writing into the folder ``tag`` and not yet committed or aborted there
    (or died doing so): its start mark is there. With ``other_than`` (a save id), only a mark of another
    save counts: one that a committed save's rank left (it died before removing it) is no write under way."""
    marks = [name for name in storage.list_dir(f"{tag}/{MARKER_DIR}") if is_start_mark(name)]
    if other_than is None:
        return bool(marks)
    for name in marks:
        try:
            if storage.read_bytes(f"{tag}/{MARKER_DIR}/{name}").decode(errors="replace") != other_than:
                return True
        except FileNotFoundError:  # removed meanwhile: that rank committed or aborted
            continue
    return False


def started_here(storage: Storage, tag: str) -> bool:
    """Whether the folder ``tag`` (without a readable manifest) holds a save of async_ckpt's: a start mark,
    or a deletion mark names it and none of its files is newer than that mark (else the name was reused
    since, say by stock DeepSpeed). Without either it may be another writer's checkpoint."""
    if has_start_mark(storage, tag):
        return True
    try:
        deleting_since = storage.modified(deletion_mark(tag))
    except FileNotFoundError:
        return False
    return newest_mtime(storage, tag) <= deleting_since


def refuse_unsupported_latest(storage: Storage, name: str = LATEST) -> None:
    """Raise :class:`UnsupportedManifestError` where ``name`` (``latest``) names a tag whose manifest is in
    another async_ckpt version's format: a load must not resume an older tag in place of what the run saved
    last. One read of ``latest`` and one of that manifest; a missing, corrupt or misnamed tag is the tag
    choice's to report, and a failing read is raised (it must not let an older tag be taken instead)."""
    latest, _ = inspect_latest(storage, name)
    if latest is None:
        return
    try:
        read_manifest(storage, validate_tag(latest))
    except UnsupportedManifestError as exc:
        raise UnsupportedManifestError(f"{name!r} at {storage.url} names {latest!r}: {exc}") from None
    except (CorruptManifestError, InvalidTagError):  # resolve() and choose_tag() say so
        return


def list_tags(storage: Storage) -> list[TagInfo]:
    """Every tag folder under the root; committed ones last, ordered by ``Manifest.recency`` (save time,
    then step), newest last."""
    infos = []
    for name in storage.list_dir(""):
        if name.startswith(".") or name == MARKER_DIR or not storage.is_dir(name):
            continue
        if not storage.exists(f"{name}/{MANIFEST}") and not holds_files(storage, name):
            continue  # no file yet (or none left after an abort): not a tag
        try:
            infos.append(TagInfo(name, read_manifest(storage, name)))
        except CorruptManifestError as exc:
            infos.append(TagInfo(name, None, error=str(exc)))
        except UnsupportedManifestError as exc:
            infos.append(TagInfo(name, None, error=str(exc), unsupported=True))
    return sorted(infos, key=lambda i: (i.committed, i.manifest.recency if i.manifest else (0.0, -1), i.tag))
