"""Export: turn a committed ZeRO checkpoint into a Hugging Face model folder.

The consolidation is DeepSpeed's own (``zero_to_fp32``'s ``get_fp32_state_dict_from_zero_checkpoint``,
which merges every rank's fp32 partitions); this module only fetches the files it needs, casts,
and writes the result the way ``transformers`` expects: weight shards with an index, plus the
tokenizer and model config that the commit stored in the tag folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import torch

from async_ckpt.consolidated import (DEFAULT_SHARD_BYTES, SAFETENSORS_INDEX, TORCH_INDEX, index_json, nbytes,
                                     plan_shards, set_config_dtype, shard_names, without_aliases)
from async_ckpt.errors import ConversionError, UsageError
from async_ckpt.layout import MANIFEST
from async_ckpt.manifest import Manifest
from async_ckpt.pull import local_view
from async_ckpt.storage.base import Storage

logger = logging.getLogger("async_ckpt")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PARTIAL = ".async_ckpt-export.partial-"  # the folder inside --out an export is staged in
_LOCK = ".lock"  # in that folder: held while the export runs


@dataclass
class ExportReport:
    tag: str
    out_dir: str
    dtype: str
    tensors: int = 0
    total_bytes: int = 0
    shards: list[str] = field(default_factory=list)
    tied_aliases: list[str] = field(default_factory=list)
    extra_files: list[str] = field(default_factory=list)


def export_hf(storage: Storage, manifest: Manifest, out_dir: str, *, dtype: str = "fp32",
              safetensors: bool = True, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              show_progress: bool = True) -> ExportReport:
    """Write the consolidated weights of ``manifest``'s tag to ``out_dir`` as a Hugging Face folder.

    Tied weights (e.g. ``lm_head.weight`` sharing ``wte.weight``) are written once, as
    ``save_pretrained`` does; ``from_pretrained`` ties them again from the config. The files are
    written under a ``.partial-`` folder inside ``out_dir`` (a mount point or a symlink may be given:
    nothing is renamed onto it) and take their place only once all are complete, the shard index last:
    an export that fails leaves no shards without their index in ``out_dir``, nor does one killed before
    those renames (a kill among them, a matter of milliseconds, can). A second export into the same
    folder while one runs is refused (the first holds a lock on its ``.partial-`` folder from the start);
    one that finds a killed export's ``.partial-`` folder removes it.
    """
    if manifest.consolidated:
        raise UsageError(f"tag {manifest.tag!r} is a consolidated save: it already is a Hugging Face folder (or "
                         "DeepSpeed's 16-bit model file); `async-ckpt pull` it and load it with from_pretrained")
    if manifest.universal:
        raise UsageError(f"tag {manifest.tag!r} is a universal checkpoint, which zero_to_fp32 cannot consolidate: "
                         "export the ZeRO tag it was converted from (or load it with checkpoint.load_universal)")
    if manifest.zero_stage == 0 and not any("zero_pp_rank_" in entry.path for entry in manifest.files):
        raise UsageError(f"tag {manifest.tag!r} was saved without ZeRO partitioning (stage 0): zero_to_fp32 has no "
                         "shards to consolidate. Its weights are whole in mp_rank_00_model_states.pt under 'module': "
                         "`async-ckpt pull` it and load that file with torch.load")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    if max_shard_bytes <= 0:
        raise UsageError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = os.path.expanduser(out_dir)  # the shell leaves the ~ of --out=~/x; so would a quoted path
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"--out {out_dir} is a file; export into a new or empty folder")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    created = not os.path.isdir(out_dir)
    partial = os.path.join(out_dir, f"{_PARTIAL}{uuid.uuid4().hex[:8]}")
    moved: list[str] = []
    try:
        os.makedirs(partial)
        # a scratch folder that cannot be removed must not fail (and so remove) an export already in place
        with _held(partial), tempfile.TemporaryDirectory(prefix="async_ckpt_export_",
                                                         ignore_cleanup_errors=True) as scratch:
            _clear_killed_exports(out_dir, partial)
            if _others(out_dir, partial):
                raise UsageError(f"--out {out_dir} is not empty; export into a new or empty folder")
            root = local_view(storage, manifest, scratch, show_progress=show_progress)
            with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's progress prints; stdout is for --json
                try:
                    state = get_fp32_state_dict_from_zero_checkpoint(root, tag=manifest.tag)
                except (NotImplementedError, ValueError) as exc:  # its refusal of a layout: AutoEP under ZeRO-3;
                    # BF16_Optimizer's files (bf16 with fp32 gradient accumulation, MoE), "not a zero checkpoint"
                    raise ConversionError(f"DeepSpeed's zero_to_fp32 cannot consolidate tag {manifest.tag!r}: {exc}. "
                                          "`async-ckpt to-universal` converts the layouts ds_to_universal "
                                          "reads") from exc
            report = ExportReport(tag=manifest.tag, out_dir=out_dir, dtype=dtype)
            tensors, report.tied_aliases = without_aliases(state)
            _write_shards(cast(tensors, dtype), partial, safetensors, max_shard_bytes, report)
            tag_dir = os.path.join(root, manifest.tag)
            for entry in manifest.files:
                if entry.path.endswith(".pt") or entry.path == MANIFEST or "/" in entry.path:
                    continue
                shutil.copyfile(os.path.join(tag_dir, entry.path), os.path.join(partial, entry.path))
                report.extra_files.append(entry.path)
            if "config.json" in report.extra_files:
                set_config_dtype(os.path.join(partial, "config.json"), DTYPES[dtype])
            others = _others(out_dir, partial)
            if others:
                raise UsageError(f"--out {out_dir} got {', '.join(others[:3])}{' ...' if len(others) > 3 else ''} "
                                 "while this export ran (another export into the same folder?); nothing of this "
                                 "export was moved there: export into a new or empty folder")
            written = sorted(set(os.listdir(partial)) - {_LOCK}, key=lambda n: n in (SAFETENSORS_INDEX, TORCH_INDEX))
            for name in written:
                os.replace(os.path.join(partial, name), os.path.join(out_dir, name))  # the shard index last
                moved.append(name)
    except BaseException:
        for name in moved:  # a failure among the renames: no shard stays without its index
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(out_dir, name))
        shutil.rmtree(partial, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)
        raise
    shutil.rmtree(partial, ignore_errors=True)  # its lock file, released: the export is complete
    logger.info("exported %s to %s: %d tensors, %.3f GB %s in %d shard(s), tied aliases %s, with %s",
                manifest.tag, out_dir, report.tensors, report.total_bytes / 1e9, dtype, len(report.shards),
                report.tied_aliases or "none", report.extra_files or "no tokenizer/config")
    return report


def _others(out_dir: str, partial: str) -> list[str]:
    """What ``out_dir`` holds besides this export's staging folder ``partial``."""
    return sorted(set(os.listdir(out_dir)) - {os.path.basename(partial)})


def _clear_killed_exports(out_dir: str, partial: str) -> None:
    """Remove the staging folders that exports killed in ``out_dir`` left (not this export's, ``partial``);
    refuse (``UsageError``) where a running export holds one (:func:`_held`): removing it would delete that
    export's files under it. Two exports started together into one folder both refuse."""
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if name.startswith(_PARTIAL) and path != partial and not _removed_unless_held(path):
            raise UsageError(f"another export is writing into --out {out_dir} (its staging folder {name}); wait for "
                             "it to finish, or export into another folder")


@contextlib.contextmanager
def _held(partial: str) -> Iterator[None]:
    """Hold the lock file in this export's staging folder ``partial`` for the block: the mark of a running
    export (an exclusive ``flock`` on a file open for writing, which NFS's emulation with POSIX locks takes
    too). Where the filesystem refuses locks the block runs without one, and another export there takes
    the folder for a killed one's. Raises if another export removed the folder first, taking it for a
    killed one's in the moment before this lock."""
    fd = os.open(os.path.join(partial, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another export's check holds it for a moment at most
        except OSError as exc:
            logger.debug("no lock on %s (%s)", partial, exc)
        if os.fstat(fd).st_nlink == 0:
            raise UsageError(f"another export into {os.path.dirname(partial)} removed this export's staging folder "
                             "as it started; export into another folder")
        yield
    finally:
        os.close(fd)  # releases the lock


def _removed_unless_held(partial: str) -> bool:
    """Remove a staging folder unless a running export holds it (:func:`_held`); whether it was removed.
    The removal runs under the lock, so that an export about to take it finds its folder gone."""
    try:
        fd: int | None = os.open(os.path.join(partial, _LOCK), os.O_RDWR)
    except OSError:  # no lock file: an export killed before it made one
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            except OSError as exc:  # no locks on this filesystem
                logger.debug("no lock on %s (%s)", partial, exc)
        shutil.rmtree(partial, ignore_errors=True)
        return True
    finally:
        if fd is not None:
            os.close(fd)


def cast(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The floating-point tensors in ``dtype``; integer and bool buffers (a step counter, a mask) keep
    theirs, as ``save_pretrained`` and DeepSpeed's ``zero_to_fp32`` keep them."""
    return {name: (t.to(DTYPES[dtype]) if t.is_floating_point() else t).contiguous() for name, t in tensors.items()}


def _write_shards(tensors: dict[str, torch.Tensor], out_dir: str, safetensors: bool, max_shard_bytes: int,
                  report: ExportReport) -> None:
    shards = plan_shards(tensors, max_shard_bytes)
    names = shard_names(len(shards), safetensors=safetensors)
    for shard, file_name in zip(shards, names):
        path = os.path.join(out_dir, file_name)
        if safetensors:
            from safetensors.torch import save_file

            save_file(shard, path, metadata={"format": "pt"})
        else:  # torch.save writes a tensor's whole storage: zero_to_fp32's are views of one flat buffer
            torch.save({name: t if t.untyped_storage().nbytes() == nbytes(t) else t.clone()
                        for name, t in shard.items()}, path)
        report.shards.append(file_name)
    report.tensors = len(tensors)
    report.total_bytes = sum(nbytes(t) for t in tensors.values())
    with open(os.path.join(out_dir, SAFETENSORS_INDEX if safetensors else TORCH_INDEX), "wb") as fh:
        fh.write(index_json(shards, names))
