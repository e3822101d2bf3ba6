"""async_ckpt: non-blocking DeepSpeed ZeRO checkpoints to local disk, NFS and object storage.

``ckpt = async_ckpt.wrap(engine, url)`` then ``ckpt.save()`` returns once the state is
snapshotted; a background thread writes and commits it. See the README for guarantees.

``wrap`` and ``AsyncCheckpointer`` are imported on first use: they pull in DeepSpeed (seconds to
import), which code that only takes the configuration, the errors or a storage backend does not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from async_ckpt.config import CheckpointConfig
from async_ckpt.errors import (AsyncCkptError, CheckpointerClosedError, CheckpointNotFoundError, ConfigError,
                               ConversionError, CorruptManifestError, InvalidTagError, MissingFileError,
                               NotCommittedError, SaveFailedError, StorageError, TagExistsError, TagMismatchError,
                               UnsupportedManifestError, UsageError, VerificationError, WaitTimeoutError,
                               ZipLayoutError)
from async_ckpt.handle import SaveHandle, SaveResult

__version__ = "0.1.0"

if TYPE_CHECKING:
    from async_ckpt.checkpointer import AsyncCheckpointer, wrap
    from async_ckpt.inflight import wait_all

_LAZY = {"wrap": "async_ckpt.checkpointer", "AsyncCheckpointer": "async_ckpt.checkpointer",
         "wait_all": "async_ckpt.inflight"}

__all__ = [
    "wrap", "wait_all", "AsyncCheckpointer", "CheckpointConfig", "SaveHandle", "SaveResult",
    "AsyncCkptError", "ConfigError", "InvalidTagError", "TagExistsError", "StorageError", "SaveFailedError",
    "CheckpointNotFoundError", "NotCommittedError", "VerificationError", "CheckpointerClosedError", "UsageError",
    "ConversionError", "CorruptManifestError", "UnsupportedManifestError", "WaitTimeoutError", "TagMismatchError",
    "ZipLayoutError", "MissingFileError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'async_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
