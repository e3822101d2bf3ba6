"""Convert a committed ZeRO checkpoint to DeepSpeed's universal format, from any storage to any storage.

A ZeRO checkpoint loads only on the data-parallel size that saved it. DeepSpeed's
``ds_to_universal`` rewrites it as one folder per parameter (fp32 weights and optimizer moments),
which ``checkpoint.load_universal`` loads on any number of ranks. The conversion itself is
DeepSpeed's, run as its own script in a child process; this module pulls the input into a local
folder, pushes the output to the destination, and commits it like a save: a manifest with every
file's size and CRC-32, then ``latest_universal``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

from async_ckpt.catalog import holds_files, read_manifest, started_here
from async_ckpt.commit import delete_tag, mark_started, remove_bookkeeping
from async_ckpt.errors import ConversionError, TagExistsError, UsageError
from async_ckpt.layout import LATEST_UNIVERSAL, MANIFEST, manifest_path, validate_tag
from async_ckpt.manifest import FileEntry, Manifest
from async_ckpt.pull import local_view
from async_ckpt.serialization import copy_local_file
from async_ckpt.storage.base import Storage

logger = logging.getLogger("async_ckpt")


@dataclass
class UniversalReport:
    source_tag: str
    tag: str
    url: str
    files: int
    total_bytes: int
    seconds: float


def to_universal(source: Storage, manifest: Manifest, dest: Storage, *, tag: str | None = None,
                 workers: int = 2, show_progress: bool = True) -> UniversalReport:
    """Convert ``manifest``'s tag and commit the result at ``dest`` as ``tag`` (default ``<tag>_universal``)."""
    if manifest.universal:
        raise UsageError(f"tag {manifest.tag!r} is already a universal checkpoint")
    if manifest.consolidated:
        raise UsageError(f"tag {manifest.tag!r} is a consolidated save (the whole model's weights, no optimizer "
                         "states), which ds_to_universal cannot convert: convert a ZeRO checkpoint's tag")
    out_tag = validate_tag(tag or f"{manifest.tag}_universal")
    # An --out that cannot be written fails now, not after the conversion. A refusal below leaves no new
    # folder: a tag it refuses is in --out, which therefore existed.
    dest.probe()
    _refuse_taken(dest, out_tag)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="async_ckpt_universal_") as scratch:
        root = local_view(source, manifest, scratch, show_progress=show_progress)
        out_dir = os.path.join(scratch, "out", out_tag)
        _run_ds_to_universal(os.path.join(root, manifest.tag), out_dir, workers,
                             f"tag {manifest.tag!r} of {source.url}")
        _refuse_taken(dest, out_tag, " (since this conversion began)")  # another conversion into it, meanwhile
        if holds_files(dest, out_tag):  # a conversion into it that did not commit: its files of another layout
            # (another model-parallel size's mp_rank_* files, say) would stay beside these, and DeepSpeed globs them
            logger.warning("tag %s at %s holds the files of a conversion into it that did not commit: removed "
                           "before this one's are written", out_tag, dest.url)
            delete_tag(dest, out_tag)
        save_id = uuid.uuid4().hex
        mark_started(dest, out_tag, 0, save_id)  # a push cut short is then gc's to remove
        entries = _push(dest, out_tag, out_dir, os.path.join(root, manifest.tag), manifest)
    converted = Manifest(tag=out_tag, step=manifest.step, world_size=manifest.world_size,
                         zero_stage=manifest.zero_stage, dtype=manifest.dtype,
                         files=sorted(entries, key=lambda e: e.path), versions=dict(manifest.versions),
                         created_unix=time.time(), save_id=save_id, universal=True)
    dest.write_bytes(manifest_path(out_tag), converted.to_json())
    dest.write_bytes(LATEST_UNIVERSAL, out_tag.encode())
    remove_bookkeeping(dest, out_tag)
    report = UniversalReport(source_tag=manifest.tag, tag=out_tag, url=dest.url, files=len(entries),
                             total_bytes=converted.total_bytes, seconds=time.perf_counter() - started)
    logger.info("converted %s to universal tag %s at %s: %d files, %.3f GB in %.1f s", manifest.tag, out_tag,
                dest.url, report.files, report.total_bytes / 1e9, report.seconds)
    return report


def _refuse_taken(dest: Storage, out_tag: str, when: str = "") -> None:
    """:class:`TagExistsError` where ``out_tag`` at ``dest`` is committed, or its folder holds files async_ckpt
    did not start; ``when`` says since when, for a check made again."""
    if read_manifest(dest, out_tag) is not None:
        raise TagExistsError(f"tag {out_tag!r} already exists at {dest.url}{when}; pass another --out-tag or remove it")
    if holds_files(dest, out_tag) and not started_here(dest, out_tag):
        raise TagExistsError(f"folder {out_tag!r} at {dest.url} holds files async_ckpt did not write{when} (a "
                             "conversion of DeepSpeed's own?); pass another --out-tag or move it away")


def _run_ds_to_universal(input_folder: str, output_folder: str, workers: int, what: str) -> None:
    """DeepSpeed's converter on the local view ``input_folder`` of ``what`` (named in its failure: the view
    is a temporary folder, gone by the time the error is read)."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", input_folder,
           "--output_folder", output_folder, "--num_extract_workers", str(workers),
           "--num_merge_workers", str(workers), "--inject_missing_state"]
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise ConversionError(f"DeepSpeed's ds_to_universal failed (exit {done.returncode}) on {what}:\n{tail}")
    logger.debug("ds_to_universal output:\n%s", done.stdout[-4000:])


def _push(dest: Storage, out_tag: str, out_dir: str, source_tag_dir: str, manifest: Manifest) -> list[FileEntry]:
    """Upload the converted folder, plus the tokenizer/config files of the source tag."""
    entries = []
    for folder, _, names in os.walk(out_dir):
        for name in sorted(names):
            local = os.path.join(folder, name)
            rel = os.path.relpath(local, out_dir).replace(os.sep, "/")
            entries.append(copy_local_file(dest, f"{out_tag}/{rel}", local, tag_dir=out_tag, rank=0))
    for entry in manifest.files:
        if not entry.path.endswith(".pt") and entry.path != MANIFEST:
            local = os.path.join(source_tag_dir, *entry.path.split("/"))
            entries.append(copy_local_file(dest, f"{out_tag}/{entry.path}", local, tag_dir=out_tag, rank=0))
    return entries
