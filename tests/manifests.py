"""Committed tags written by hand, for the unit tests of what reads manifests: ordering, retention, tiers, gc."""

from __future__ import annotations

from async_ckpt.layout import manifest_path
from async_ckpt.manifest import Manifest
from async_ckpt.storage import Storage


def commit_by_hand(storage: Storage, tag: str, step: int, *, saved_at: float | None = None,
                   save_id: str | None = None) -> None:
    """Write ``tag``'s manifest (no files): saved at ``saved_at`` (default: ``step`` seconds after the
    epoch), by the save ``save_id`` (default ``save-<tag>``)."""
    manifest = Manifest(tag=tag, step=step, world_size=1, zero_stage=2, dtype="fp32", files=[],
                        created_unix=float(step) if saved_at is None else saved_at, save_id=save_id or f"save-{tag}")
    storage.write_bytes(manifest_path(tag), manifest.to_json())
