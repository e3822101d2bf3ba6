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
  rank's data is durable.
* ``preserves_storage_sharing()`` is true, as for DeepSpeed's own Torch engine: the snapshot keeps
  views that share a storage sharing one staged storage (that is what makes the files byte-identical).
  DeepSpeed consults the flag for MoE saves and for pipeline-parallel (``PipelineModule``) layer
  saves, where it then clones the state first so that each file holds just its own tensors;
  without the clone such files would carry whole flat buffers. That clone is DeepSpeed's,
  synchronous, and counts in the stall. Plain ZeRO saves hand their state over uncloned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
