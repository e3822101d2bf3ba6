"""The thin adapter that plugs async_ckpt into DeepSpeed's checkpoint-engine hook.

DeepSpeed's ``save_checkpoint`` decides *what* is saved (which dicts, which file names, which
rank writes what) and hands each file to ``CheckpointEngine.save``. This adapter receives those
calls and forwards them to the checkpointer, which snapshots instead of writing. Everything else
about a checkpoint stays DeepSpeed's.

Two DeepSpeed behaviours are used deliberately:

* ``is_decoupled()`` is true, so DeepSpeed neither calls ``commit`` nor writes ``latest`` inside
  ``save_checkpoint``. Instead, at the next ``engine.step()`` on a gradient-accumulation boundary
  and *before* the optimizer step, it asks ``get_commit_info()``: that is the point where a
  snapshot still copying in the background must be finished. We wait there and return ``None``,
  so DeepSpeed adds no barrier and writes no ``latest``: async_ckpt commits by itself, once every
  rank's data is durable. ``PipelineEngine.train_batch()`` steps the optimizer without asking, so
  ``wrap()`` also stands in for the engine's ``_take_model_step``, which waits the same way first.
* ``preserves_storage_sharing()`` is true, as for DeepSpeed's own Torch engine: the snapshot keeps
  views that share a storage sharing one staged storage (that is what makes the files byte-identical).
  DeepSpeed consults the flag for MoE saves and for pipeline-parallel (``PipelineModule``) layer
  saves, where it then clones the state first (``clone_tensors_for_torch_save``) so that each file
  holds just its own tensors. The snapshot copies to host memory anyway, so cloning first would
  copy everything twice on the training thread: while async_ckpt saves, :func:`deferred_clones`
  turns DeepSpeed's clone into a :class:`CloneRequest`, and the snapshot stages those tensors
  compactly instead, exactly as the clone would have laid them out. Should a DeepSpeed release
  clone through another name, its own clone simply runs: slower, never different.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

if TYPE_CHECKING:
    from async_ckpt.checkpointer import AsyncCheckpointer


class AsyncCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` that routes saves to an :class:`AsyncCheckpointer`."""

    def __init__(self, checkpointer: "AsyncCheckpointer") -> None:
        super().__init__(config_params=None)
        self.name = "AsyncCkptCheckpointEngine"
        self._checkpointer = checkpointer

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._checkpointer._on_makedirs(path)

    def save(self, state_dict: Any, path: str) -> None:
        self._checkpointer._on_file(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def is_decoupled(self) -> bool:
        return True

    def get_commit_info(self) -> None:
        self._checkpointer._before_optimizer_step()
        return None

    def cleanup(self) -> None:
        self._checkpointer._on_engine_destroy()

    def preserves_storage_sharing(self) -> bool:
        return True


#: The modules that clone state for storage-sharing engines before ``checkpoint_engine.save``.
_CLONING_MODULES = ("deepspeed.runtime.engine", "deepspeed.runtime.pipe.module")


class CloneRequest:
    """State DeepSpeed asked to clone to the CPU before saving: the snapshot does that copy instead."""

    def __init__(self, item: Any) -> None:
        self.item = item


def _request_clone(item: Any, device: Any = "cpu") -> Any:
    return CloneRequest(item) if torch.device(device).type == "cpu" else _ORIGINAL_CLONE(item, device)


def _original_clone() -> Any:
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    return clone_tensors_for_torch_save


_ORIGINAL_CLONE = _original_clone()


@contextlib.contextmanager
def deferred_clones() -> Iterator[None]:
    """Within this block DeepSpeed's ``clone_tensors_for_torch_save`` returns a :class:`CloneRequest`.

    Only the training thread saves, and only inside this block, so the swap is not seen elsewhere.
    """
    swapped = []
    for name in _CLONING_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "clone_tensors_for_torch_save", None) is _ORIGINAL_CLONE:
            module.clone_tensors_for_torch_save = _request_clone
            swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            module.clone_tensors_for_torch_save = _ORIGINAL_CLONE


#: Where DeepSpeed's optimizers keep this rank's fp32 master partitions: ZeRO-3, ZeRO-1/2, the bf16 optimizer.
_FP32_PARTITIONS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


class SnapshotEstimate(NamedTuple):
    """What a rank's snapshot will need, from the engine before any save (see :func:`estimate_snapshot`)."""

    nbytes: int
    #: Where the fp32 partitions live (most of the bytes): on CUDA, staging worth pinning ahead of the
    #: first save; on the CPU (ZeRO-Offload, CPU training), copies that pinning would not speed up.
    device: torch.device | None
    #: At most how many tensors the snapshot stages: each staged buffer takes room beyond its bytes
    #: (its placement), which a reserve of ``nbytes`` alone would not hold.
    buffers: int = 0


def estimate_snapshot(engine: Any) -> SnapshotEstimate:
    """Host bytes this rank's snapshot will need: Adam's fp32 master partitions and its two moments
    (three times the partitions; the moments may not exist before the first step) plus this rank's
    module parameters and buffers where this rank writes the model-states file (DeepSpeed's
    ``save_non_zero_checkpoint``: every rank under ZeRO-3, which saves its parameters as empty
    placeholders, the first data-parallel rank otherwise), and how many tensors hold them (each
    partition, its moments and step; each parameter and buffer). An estimate, for reserving staging
    memory ahead of the first save; 0 bytes where the engine's optimizer keeps no partitions we know."""
    optimizer = getattr(engine, "optimizer", None)
    partitions = next((getattr(optimizer, name) for name in _FP32_PARTITIONS if getattr(optimizer, name, None)), None)
    if partitions is None:
        base = optimizer
        while getattr(base, "optimizer", None) is not None:  # mixed-precision wrappers around a torch optimizer
            base = base.optimizer
        partitions = [p for group in getattr(base, "param_groups", ()) for p in group["params"]]
    tensors = [t for t in partitions if isinstance(t, torch.Tensor)]
    fp32 = sum(t.numel() * t.element_size() for t in tensors)
    if not fp32:
        return SnapshotEstimate(0, None)
    saved = [*engine.module.parameters(), *engine.module.buffers()] \
        if getattr(engine, "save_non_zero_checkpoint", True) else []
    module = sum(t.numel() * t.element_size() for t in saved if not hasattr(t, "ds_tensor"))  # ds_tensor: ZeRO-3
    return SnapshotEstimate(3 * fp32 + module, tensors[0].device, buffers=4 * len(tensors) + len(saved))
