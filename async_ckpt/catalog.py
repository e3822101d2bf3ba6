"""What a checkpoint root holds: its tags, which of them are committed, and what ``latest`` says."""

from __future__ import annotations

from dataclasses import dataclass

from async_ckpt.layout import LATEST, MANIFEST, MARKER_DIR, manifest_path
from async_ckpt.manifest import Manifest
from async_ckpt.storage.base import Storage


@dataclass(frozen=True)
class TagInfo:
    tag: str
    manifest: Manifest | None

    @property
    def committed(self) -> bool:
        return self.manifest is not None


def read_latest(storage: Storage, name: str = LATEST) -> str | None:
    """The tag ``latest`` (or ``latest_universal``, with ``name``) names; ``None`` if absent or empty."""
    try:
        text = storage.read_bytes(name).decode().strip()
    except FileNotFoundError:
        return None
    return text or None


def read_manifest(storage: Storage, tag: str) -> Manifest | None:
    try:
        return Manifest.from_json(storage.read_bytes(manifest_path(tag)))
    except FileNotFoundError:
        return None


def list_tags(storage: Storage) -> list[TagInfo]:
    """Every tag folder under the root, committed ones ordered by step then commit time, last newest."""
    infos = []
    for name in storage.list_dir(""):
        if name.startswith(".") or name == MARKER_DIR or not storage.is_dir(name):
            continue
        if not storage.exists(f"{name}/{MANIFEST}") and not storage.list_dir(name):
            continue
        infos.append(TagInfo(name, read_manifest(storage, name)))
    return sorted(infos, key=lambda i: (i.committed, i.manifest.step if i.manifest else -1,
                                        i.manifest.created_unix if i.manifest else 0.0, i.tag))
