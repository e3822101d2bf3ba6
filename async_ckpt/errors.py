"""The exceptions async_ckpt raises.

Every error says what went wrong and what to do about it. They share one base class so that a
training script can catch everything async_ckpt raises with a single ``except AsyncCkptError``.
"""

from __future__ import annotations


class AsyncCkptError(Exception):
    """Base class of every error raised by async_ckpt."""


class ConfigError(AsyncCkptError, ValueError):
    """An option, URL or argument is invalid. Raised before anything is written."""


class InvalidTagError(ConfigError):
    """A checkpoint tag cannot be used as a folder name on every storage backend."""


class TagExistsError(ConfigError):
    """The tag is already committed, or its folder holds another writer's checkpoint: saving would
    overwrite or mix into a good checkpoint."""


class StorageError(AsyncCkptError):
    """The destination cannot be read or written (missing, unwritable, unreachable)."""


class MissingFileError(StorageError, FileNotFoundError):
    """A file to fetch does not exist in storage (not a local path that is missing). A load reports a file gone
    from a committed tag as a :class:`VerificationError`, and with ``fallback=True`` falls back from it."""


class SaveFailedError(AsyncCkptError):
    """A background save did not reach a commit. The previous checkpoint is intact.

    ``tag`` is the save's tag and ``url`` the root it was written to (a local folder's absolute path), where
    known: a tag alone does not say which save failed when two roots got one of the same name."""

    def __init__(self, message: str, *, tag: str | None = None, url: str | None = None) -> None:
        super().__init__(message)
        self.tag = tag
        self.url = url


class ZipLayoutError(AsyncCkptError):
    """torch.save wrote its zip records in an order async_ckpt does not know; the file is not written.

    Their CRC-32s cannot be filled in (:mod:`async_ckpt.torch_zip`). Report it with the torch version."""


class CheckpointNotFoundError(AsyncCkptError, FileNotFoundError):
    """No checkpoint (or no such tag) exists at the destination."""


class NotCommittedError(AsyncCkptError):
    """The tag exists but was never committed: its data may be incomplete."""


class VerificationError(AsyncCkptError):
    """A file's size or checksum does not match the manifest."""


class CorruptManifestError(VerificationError):
    """A tag's manifest cannot be read (not JSON, not a manifest): the tag counts as corrupt, never committed."""


class UnsupportedManifestError(AsyncCkptError):
    """A tag's manifest is in a format of another async_ckpt version (``async_ckpt/N``) that this one does
    not read: not corrupt, so this version neither loads it nor deletes it (gc, retention). Upgrade
    async_ckpt to load it."""


class WaitTimeoutError(AsyncCkptError, TimeoutError):
    """A bounded wait ran out (``save()`` for the previous save, ``wait()``, ``close()``, a save handle's
    ``result``, ``exception`` and ``local_result`` with a ``timeout``); the message names the tag and what was
    awaited (the rank too, but for a handle's wait). Raise ``CheckpointConfig.wait_timeout_s``, or the timeout
    given, if the storage is merely slow."""


class CheckpointerClosedError(AsyncCkptError, RuntimeError):
    """The checkpointer was closed; create a new one with ``async_ckpt.wrap``."""


class UsageError(AsyncCkptError, RuntimeError):
    """The API was called in a way that cannot work (wrong engine, wrong rank setup...)."""


class TagMismatchError(UsageError):
    """Ranks passed different tags to one save. ``ckpt.save()`` refuses; ``engine.save_checkpoint``
    under DeepSpeed's ``checkpoint.tag_validation`` WARN/IGNORE saves such per-rank tags as DeepSpeed
    does (synchronously, never committed), and under FAIL raises DeepSpeed's own AssertionError."""


class ConversionError(AsyncCkptError):
    """A DeepSpeed conversion tool (``ds_to_universal``, ``zero_to_fp32``) failed; the message has its output."""
