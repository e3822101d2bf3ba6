"""Consolidated saves: every parameter gathered to rank 0 and written as a Hugging Face weights folder.

DeepSpeed tells partitioned checkpoints (each rank's shard: what training resumes from) from
consolidated ones (the whole model on rank 0: what inference and export load). The gather is
DeepSpeed's own and, under ZeRO-3, a collective, so it runs on the training thread of every rank
(:func:`gather_state_dict`); rank 0 snapshots the result, and its background writer streams it
here (:func:`write_weights`) as safetensors shards plus their index, the layout ``save_pretrained``
writes and ``from_pretrained`` reads. ``async-ckpt export`` writes the same layout offline: the
rules both follow (tied aliases, shard plan, file names, index, config dtype) live here once.

A shard is streamed, never assembled: the safetensors header, then each tensor's bytes straight
from its staging buffer, contiguous in offset order, through ``Storage.open_write`` and a
:func:`~async_ckpt.serialization.write_chunks` (size and CRC-32 for the manifest).
"""

from __future__ import annotations

import itertools
import json
import struct
from typing import Any

import torch

from async_ckpt.errors import UsageError
from async_ckpt.manifest import FileEntry
from async_ckpt.serialization import write_chunks
from async_ckpt.storage.base import Storage

DEFAULT_SHARD_BYTES = 5 * 1000**3
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"

#: torch dtypes as the safetensors format names them.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
#: The header's length is padded to this (with spaces, as safetensors does) so tensor data is aligned.
_HEADER_ALIGN = 8


def refuse_partial_export(engine: Any, call: str, *, exclude_frozen_parameters: bool = False) -> None:
    """:class:`~async_ckpt.UsageError` for an engine whose ranks each hold part of the model outside what
    :func:`gather_state_dict` gathers: a pipeline's stages (and its module_state_dict writes layer files
    into the last checkpoint DeepSpeed loaded), expert parallelism's experts, AutoTP's slices under ZeRO-3;
    and for ``exclude_frozen_parameters`` with AutoTP, whose gather takes every parameter."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    refuse = getattr(engine, "_raise_if_autoep_zero3_consolidated_export", None)
    if refuse is not None and engine.zero_optimization_partition_weights():
        refuse(call)  # DeepSpeed's own refusal (AutoEP under ZeRO-3), naming the call
    why = None
    if isinstance(engine, PipelineEngine):
        why = "a pipeline's stages each hold their own layers"
    elif any(getattr(module, "ep_size", 1) > 1 for module in engine.module.modules()) or (
            getattr(engine, "_has_autoep_layers", lambda: False)()):
        why = "expert parallelism leaves each rank its own experts"
    elif engine.autotp_size() > 1 and engine.zero_optimization_partition_weights():
        why = "DeepSpeed gathers AutoTP's slices and ZeRO-3's partitions apart, not both at once"
    elif engine.autotp_size() > 1 and exclude_frozen_parameters:
        why = "DeepSpeed's gather of AutoTP's slices takes every parameter (exclude_frozen_parameters=True)"
    if why is not None:
        raise UsageError(f"{call} cannot gather this engine's whole model: {why}. Save a checkpoint and convert it "
                         "(`async-ckpt to-universal`, or DeepSpeed's zero_to_fp32) instead")


def gather_state_dict(engine: Any, *, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict by DeepSpeed's own gather: on rank 0 always (``None`` on the other
    ranks under ZeRO-3 and AutoTP, where every rank must call it: the gather is a collective, layer by
    layer). Call :func:`refuse_partial_export` first."""
    if engine.autotp_size() > 1:  # DeepSpeed's own gather of AutoTP's slices
        return engine._replace_module_consolidated_state_dict()
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    return engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)


def without_aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` without names whose tensor is an earlier name's tensor (tied weights such as
    ``lm_head.weight``), and those names. safetensors refuses shared tensors; ``save_pretrained``
    writes them once and ``from_pretrained`` ties them again from the config."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    kept: dict[str, torch.Tensor] = {}
    aliases: list[str] = []
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            aliases.append(name)
            continue
        seen.add(key)
        kept[name] = tensor
    return kept, aliases


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split ``tensors`` in order into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    if max_shard_bytes <= 0:
        raise UsageError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, tensor in tensors.items():
        size = nbytes(tensor)
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append({})
            filled = 0
        shards[-1][name] = tensor
        filled += size
    return shards


def shard_names(count: int, *, safetensors: bool = True) -> list[str]:
    """``model-00001-of-0000N.safetensors`` (or ``pytorch_model-...bin``), as ``save_pretrained`` names shards.

    One shard is named so too, with an index, where ``save_pretrained`` writes ``model.safetensors`` alone:
    ``from_pretrained`` reads either; a tool that opens ``model.safetensors`` by name does not."""
    stem, ext = ("model", "safetensors") if safetensors else ("pytorch_model", "bin")
    return [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)]


def index_json(shards: list[dict[str, torch.Tensor]], names: list[str]) -> bytes:
    """The shard index ``from_pretrained`` reads: total size and which file holds each tensor."""
    weight_map = {tensor: name for shard, name in zip(shards, names) for tensor in shard}
    total = sum(nbytes(t) for shard in shards for t in shard.values())
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()


def floating_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The floating-point dtype holding the most bytes: what the weights are, for ``config.json`` (a small
    fp32 buffer before bf16 weights would otherwise make ``from_pretrained(dtype="auto")`` load them in fp32)."""
    held: dict[torch.dtype, int] = {}
    for tensor in state.values():
        if tensor.is_floating_point():
            held[tensor.dtype] = held.get(tensor.dtype, 0) + nbytes(tensor)
    return max(held, key=held.__getitem__) if held else None


def set_config_dtype(path: str, dtype: torch.dtype) -> None:
    """Record the weights' dtype in a ``config.json``, as ``save_pretrained`` does."""
    with open(path) as fh:
        config = json.load(fh)
    name = str(dtype).removeprefix("torch.")
    config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = name
    with open(path, "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)


def safetensors_header(shard: dict[str, torch.Tensor]) -> bytes:
    """The 8-byte little-endian length and the JSON header of a safetensors file holding ``shard``
    in order, each tensor's data right after the previous one's."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in shard.items():
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise UsageError(f"cannot write {name} to safetensors: dtype {tensor.dtype} is not supported")
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes(tensor)]}
        offset += nbytes(tensor)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def _raw_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's bytes in row-major order: a view of its (staging) memory, copied only if not contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def write_safetensors(storage: Storage, relpath: str, shard: dict[str, torch.Tensor], *, tag_dir: str,
                      rank: int) -> FileEntry:
    """Stream ``shard`` into a safetensors file at ``relpath`` (atomically); the entry is relative to ``tag_dir``."""
    tensors = (_raw_bytes(t) for t in shard.values() if t.numel())  # lazily: one non-contiguous copy at a time
    return write_chunks(storage, relpath, itertools.chain([safetensors_header(shard)], tensors), tag_dir=tag_dir,
                   rank=rank)


def write_weights(storage: Storage, tag: str, state: dict[str, torch.Tensor], *, max_shard_bytes: int,
                  rank: int) -> list[FileEntry]:
    """The weights of a consolidated save into ``tag/``: safetensors shards and their index."""
    tensors, _ = without_aliases(state)
    shards = plan_shards(tensors, max_shard_bytes)
    names = shard_names(len(shards))
    entries = [write_safetensors(storage, f"{tag}/{name}", shard, tag_dir=tag, rank=rank)
               for shard, name in zip(shards, names)]
    entries.append(write_chunks(storage, f"{tag}/{SAFETENSORS_INDEX}", [index_json(shards, names)], tag_dir=tag,
                                rank=rank))
    return entries
