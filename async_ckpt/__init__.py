"""async_ckpt: non-blocking DeepSpeed ZeRO checkpoints to local disk, NFS and object storage.

``ckpt = async_ckpt.wrap(engine, url)`` then ``ckpt.save()`` returns once the state is
snapshotted; a background thread writes and commits it. See the README for guarantees.
"""

__version__ = "0.1.0"

from async_ckpt.checkpointer import AsyncCheckpointer, wrap  # noqa: E402
from async_ckpt.config import CheckpointConfig  # noqa: E402
from async_ckpt.errors import (AsyncCkptError, CheckpointerClosedError, CheckpointNotFoundError,  # noqa: E402
                               ConfigError, ConversionError, InvalidTagError, NotCommittedError, SaveFailedError, StorageError,
                               TagExistsError, UsageError, VerificationError)
from async_ckpt.handle import SaveHandle, SaveResult  # noqa: E402

__all__ = [
    "wrap", "AsyncCheckpointer", "CheckpointConfig", "SaveHandle", "SaveResult",
    "AsyncCkptError", "ConfigError", "InvalidTagError", "TagExistsError", "StorageError", "SaveFailedError",
    "CheckpointNotFoundError", "NotCommittedError", "VerificationError", "CheckpointerClosedError", "UsageError",
    "ConversionError",
]
