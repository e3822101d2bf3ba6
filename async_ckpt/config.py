"""All of async_ckpt's settings, in one dataclass validated at construction."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

from async_ckpt.errors import ConfigError

if TYPE_CHECKING:
    from async_ckpt.handle import SaveHandle

OnError = Literal["warn", "raise"]
MiB = 1024 * 1024


def default_cache_dir() -> str:
    """Where resumes from remote storage keep the files they fetched."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(tempfile.gettempdir())
    return os.path.join(base, "async_ckpt_cache")


@dataclass(frozen=True)
class CheckpointConfig:
    """Settings of one :class:`~async_ckpt.AsyncCheckpointer`.

    Attributes:
        url: destination root: a local/NFS path or any fsspec URL (``s3://bucket/run1``).
        storage_options: passed unchanged to fsspec (endpoint, region, credentials...).
        keep_last: keep only this many committed tags (older ones are deleted after a newer
            commit succeeded; never the one ``latest`` names). ``None`` keeps everything.
        on_error: ``"warn"`` logs a failed background save and keeps training; ``"raise"``
            additionally raises it from the next ``save()``/``wait()``.
        overlap_copy: if true, the large optimizer partitions are copied to host memory while the
            next forward/backward runs, and the next optimizer ``step()`` waits for the copy.
            Safe for training loops; not safe if you modify optimizer state by hand between
            ``save()`` and the next ``step()``. False copies everything before ``save()`` returns.
        fsync: flush file data to stable storage before a file is published (local/NFS).
        exact_bytes: make every file byte-for-byte what DeepSpeed's Torch engine writes. By
            default torch.save streams straight into storage and names the zip records inside
            each file ``archive/...`` (same tensors and dicts; every DeepSpeed tool reads them);
            True has torch.save write a local scratch file named like DeepSpeed's (next to the tag
            on local/NFS roots, in ``cache_dir`` for object stores) that is then streamed to
            storage: records named after the file, at the price of a second, buffered write
            (about 3x the time to durable here, see benchmarks/RESULTS.md).
        direct_io: write local files with O_DIRECT where the filesystem supports it (faster for
            large files: no page-cache copy); falls back to buffered writes elsewhere.
        commit_timeout_s: how long a rank waits for the other ranks' files before the save fails.
        part_size: object-store multipart part size in bytes (at least 5 MiB, S3's minimum).
        max_concurrency: object-store parts in flight per file; also parallel downloads on resume.
        upload_threads: threads (each an event loop with its own client) that share the parts of
            object-store uploads. Signing and checksumming a part costs CPU, so one thread caps
            upload speed; more than the cores you can spare buys nothing. At most max_concurrency.
        cache_dir: local folder for files fetched from remote storage on resume.
        retry_attempts: tries per object-store request before a transient error (5xx, throttling,
            timeouts, resets) fails the save.
        retry_base_delay_s: first backoff delay; it doubles per retry, with full jitter.
        verify_on_load: check size and CRC-32 of every file a rank reads before loading it.
        keep_every: with ``keep_last``, also keep every tag whose step is a multiple of this.
        writer_nice: Linux nice value (0-19) of the background threads. On machines where
            training keeps every core busy (CPU training), a positive value lets training threads
            run first: smaller slowdown, longer time to durable.
        on_save_done: called with the :class:`SaveHandle` once a save committed or failed, on
            every rank, from its writer thread: the hook for trackers (TensorBoard, W&B: log
            ``handle.metrics``, usually on rank 0 only). Exceptions it raises are logged and ignored.
    """

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # may hold credentials
    keep_last: int | None = None
    on_error: OnError = "warn"
    overlap_copy: bool = False
    fsync: bool = True
    direct_io: bool = True
    exact_bytes: bool = False
    commit_timeout_s: float = 1800.0
    part_size: int = 16 * MiB
    max_concurrency: int = 8
    upload_threads: int = 4
    cache_dir: str = field(default_factory=default_cache_dir)
    retry_attempts: int = 6
    retry_base_delay_s: float = 0.2
    verify_on_load: bool = True
    keep_every: int | None = None
    writer_nice: int = 0
    on_save_done: Callable[["SaveHandle"], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, (str, os.PathLike)) or not str(self.url).strip():
            raise ConfigError(f"url must be a non-empty path or fsspec URL, got {self.url!r}")
        object.__setattr__(self, "url", os.fspath(self.url))
        if self.storage_options is None:
            object.__setattr__(self, "storage_options", {})
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"storage_options must be a dict, got {type(self.storage_options).__name__}")
        if self.keep_last is not None and (isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int)
                                           or self.keep_last < 1):
            raise ConfigError(f"keep_last must be a positive integer or None, got {self.keep_last!r}")
        if self.on_error not in ("warn", "raise"):
            raise ConfigError(f"on_error must be 'warn' or 'raise', got {self.on_error!r}")
        if not self.commit_timeout_s > 0:
            raise ConfigError(f"commit_timeout_s must be > 0, got {self.commit_timeout_s!r}")
        if not isinstance(self.part_size, int) or self.part_size < 5 * MiB:
            raise ConfigError(f"part_size must be at least 5 MiB (S3's minimum part), got {self.part_size!r}")
        if not isinstance(self.max_concurrency, int) or not 1 <= self.max_concurrency <= 256:
            raise ConfigError(f"max_concurrency must be an integer in 1..256, got {self.max_concurrency!r}")
        if isinstance(self.upload_threads, bool) or not isinstance(self.upload_threads, int) \
                or not 1 <= self.upload_threads <= 64:
            raise ConfigError(f"upload_threads must be an integer in 1..64, got {self.upload_threads!r}")
        if not isinstance(self.retry_attempts, int) or self.retry_attempts < 1:
            raise ConfigError(f"retry_attempts must be a positive integer, got {self.retry_attempts!r}")
        if not self.retry_base_delay_s >= 0:
            raise ConfigError(f"retry_base_delay_s must be >= 0, got {self.retry_base_delay_s!r}")
        if self.keep_every is not None and (isinstance(self.keep_every, bool) or not isinstance(self.keep_every, int)
                                            or self.keep_every < 1):
            raise ConfigError(f"keep_every must be a positive number of steps or None, got {self.keep_every!r}")
        if not isinstance(self.writer_nice, int) or not 0 <= self.writer_nice <= 19:
            raise ConfigError(f"writer_nice must be an integer in 0..19, got {self.writer_nice!r}")
        if self.on_save_done is not None and not callable(self.on_save_done):
            raise ConfigError(f"on_save_done must be a callable taking the SaveHandle, got {self.on_save_done!r}")
        if not self.cache_dir:
            raise ConfigError("cache_dir must be a folder path")
