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
MAX_PART_SIZE = 5 * 1024 * MiB  # S3's largest part
_WAIT_MARGIN_S = 400.0  # wait_timeout_s's default beyond 2 * commit_timeout_s, for the save's own write
_SHORTEST_DEFAULT_WAIT_S = 4000.0
_LONGEST_S = 1e8  # about three years: any longer wait overflows neither a timedelta nor a thread join


def default_cache_dir() -> str:
    """Where resumes from remote storage keep the files they fetched: ``$XDG_CACHE_HOME/async_ckpt_cache``,
    else a folder of this user's in the temporary folder (one shared by every user would be made with
    the first one's permissions, and refuse the others' resumes)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return os.path.join(xdg, "async_ckpt_cache")
    return os.path.join(tempfile.gettempdir(), f"async_ckpt_cache-{os.getuid() if hasattr(os, 'getuid') else 0}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Settings of one :class:`~async_ckpt.AsyncCheckpointer`.

    Attributes:
        url: destination root: a local/NFS path or any fsspec URL (``s3://bucket/run1``).
        storage_options: passed unchanged to fsspec (endpoint, region, credentials...). Refused
            with a local ``url``, where they would be ignored (a URL missing its ``s3://``), unless
            every value is ``None`` (options left unset): then they count as none.
        keep_last: keep only this many committed tags, the most recently saved (older ones are
            deleted after a newer commit succeeded; never the one ``latest`` names; after a
            rollback, the abandoned later steps count as older). ``None`` keeps everything.
        on_error: ``"warn"`` logs a failed background save and keeps training; ``"raise"``
            additionally raises it from the next ``save()``/``wait()``.
        overlap_copy: the large optimizer partitions are copied to host memory while the next
            forward/backward runs, and the next optimizer ``step()`` waits for the copy: a shorter
            stall on CPU and GPU (half or less in benchmarks/RESULTS.md). Safe for training loops,
            and ``load()`` and ``engine.load_checkpoint`` wait for the copy; not safe if you modify
            optimizer state in place by hand between ``save()`` and the next ``step()``: then set
            it False, which copies everything before ``save()`` returns.
        fsync: flush file data to stable storage before a file is published (local/NFS), so that
            a tag ``latest`` names survives a crash of the machine. False publishes without the
            flush, no more durable than stock DeepSpeed's torch.save (which sends no fsync either):
            after a crash of the machine (or a VM's host), ``latest`` may name a tag whose files
            are torn or missing. On a VM whose disk emulation takes the guest's CPU, False cut a
            save's measured steal by about 40 % (benchmarks/RESULTS.md, "The disk's cache flush").
        exact_bytes: make every file byte-for-byte what DeepSpeed's Torch engine writes. By
            default torch.save streams straight into storage and names the zip records inside
            each file ``archive/...`` (same tensors and dicts; every DeepSpeed tool reads them);
            True has torch.save write a local scratch file named like DeepSpeed's (next to the tag
            on local/NFS roots, in ``cache_dir`` for object stores) that is then streamed to
            storage: records named after the file, at the price of a second, buffered write
            (1.9-3.2x the time to durable on 2 CPU ranks, see benchmarks/RESULTS.md).
        direct_io: write local files with O_DIRECT where the filesystem supports it (faster for
            large files: no page-cache copy, and the optimizer partitions go to the device straight
            from the staging buffers); falls back to buffered writes elsewhere.
        commit_timeout_s: how long rank 0 waits for every rank's files before the save fails (the
            other ranks wait up to twice this for rank 0's outcome).
        wait_timeout_s: the longest any call waits for background work: ``save()`` for the
            previous save to free the staging buffers, ``wait()`` and ``close()`` for pending
            saves (``wait(timeout=...)`` overrides it). Exceeded, they raise
            :class:`~async_ckpt.WaitTimeoutError` naming the rank, the tag and what was awaited.
            ``None`` (the default): 4000 s, or ``2 * commit_timeout_s + 400`` where that is longer,
            so that a wait outlasts a commit that times out (rank 0 waits ``commit_timeout_s`` for
            every rank's files, the others up to twice that, and 300 s more where rank 0 has begun
            to commit) when ``commit_timeout_s`` is raised.
            The field stays ``None``; :attr:`effective_wait_timeout_s` gives the value in force.
        part_size: object-store multipart part size in bytes (5 MiB to 5 GiB, S3's limits). A file
            past 1000 parts (16 GiB at the default) doubles it after every 1000 parts, and with it
            the upload's memory, so that S3's 10,000 parts reach its 5 TiB object limit (from 16 MiB).
        equal_parts: keep every part of an upload at ``part_size`` (the last excepted), for stores that
            refuse parts of different sizes (Cloudflare R2, Garage). A file then holds at most
            10,000 parts (156 GiB at the default ``part_size``); raise ``part_size`` for larger files.
        max_concurrency: object-store parts in flight per file; also parallel downloads on resume.
        upload_threads: threads (each an event loop with its own client) that share the parts of
            object-store uploads. Signing and checksumming a part costs CPU, so one thread caps
            upload speed; more than the cores you can spare buys nothing. At most max_concurrency.
        cache_dir: local folder (not a URL) for files fetched from remote storage on resume (default:
            ``$XDG_CACHE_HOME/async_ckpt_cache``, else ``async_ckpt_cache-<uid>`` in the temporary folder;
            ``~`` is expanded). After each load from a URL, the URL's other cached saves that no load used
            and nothing changed in for an hour are removed (:func:`async_ckpt.resume.prune_cache`).
        retry_attempts: tries per object-store request before a transient error (5xx, throttling,
            timeouts, resets) fails the save.
        retry_base_delay_s: first backoff delay; it doubles per retry, with full jitter.
        verify_on_load: check size and CRC-32 of every file a rank reads before loading it.
        keep_every: with ``keep_last``, also keep every tag whose step is a multiple of this.
        writer_nice: Linux nice value (0-19) of the background threads. On machines where
            training keeps every core busy (CPU training), a positive value lets training threads
            run first: smaller slowdown, longer time to durable.
        overwrite_tags: let a save reuse the tag of a committed checkpoint, as DeepSpeed's own
            ``save_checkpoint`` does. Off by default, deliberately stricter than DeepSpeed: the old
            tag is uncommitted (its manifest deleted) when the new save starts and its files are
            overwritten in place, so until the new save commits that tag is gone, and if the save
            fails it stays gone (``load()`` then takes the newest other committed tag). Off, a
            reused tag raises :class:`~async_ckpt.TagExistsError` before anything is written, and so
            does a tag whose folder holds files async_ckpt did not start (no manifest, no start mark).
        synchronous: every save (``save()``, ``engine.save_checkpoint``, consolidated saves) returns
            only once it committed on every rank, as DeepSpeed's own save returns with its files
            written; a failure is then raised or logged right there, as ``on_error`` says. Host
            tensors of DeepSpeed's checkpoint files are then written from where they are, with no
            staging copy, where the write copies them anyway (a memory filesystem, buffered files,
            object storage; not where ``O_DIRECT`` to a disk is asked for, where the staged copy is
            what spares the write a copy; consolidated saves are staged). For code that reads
            the folder itself right after each save and cannot call :func:`~async_ckpt.wait_all`
            first (DeepSpeed's own unit tests do). The whole write is then part of the stall, which
            is what async_ckpt exists to remove; the writes still go to any URL, with the manifest
            and the commit. ``None`` (default): on where training runs on the CPU and ``url`` is in
            memory (tmpfs, ramfs) with no ``local_tier``, off elsewhere. In memory a write is CPU
            work with no device to hand it to: in the background it cost CPU training 2.6-4x stock
            DeepSpeed's save, written while training waits 0.8-0.9x stock's (benchmarks/RESULTS.md,
            "ISA-L's CRC-32"). ``False`` writes in the background there too. ``True`` is refused with
            ``local_tier``: each save would wait for its drain to ``url``, so the tier would shorten none.
        local_tier: a node-local folder (NVMe, ``/dev/shm``) where each save is written and committed
            first; each rank's drainer thread then copies the committed tag to ``url`` with a commit
            of its own (see :mod:`async_ckpt.tiers`). It may be a different folder on every node: no
            shared filesystem is needed. ``load()`` restarts from the nearest tier that holds a
            rank's files. ``None``: saves go straight to ``url``.
        local_keep_last: with ``local_tier``, how many committed tags each node folder keeps; older ones
            are deleted once they are committed at ``url``, or once ``url``'s own ``keep_last`` no longer
            keeps them there.
        local_tier_max_bytes: with ``local_tier``, the most bytes each node folder may hold. A save that
            would not fit (nor in the disk's free space) goes straight to ``url``, with a warning.
        on_save_done: called with the :class:`SaveHandle` once a save committed or failed, on
            every rank, from its writer thread (with ``local_tier``, once drained, from the drainer
            thread; drains that wrap() resumes too); not on a rank whose ``save()`` raised: the hook
            for trackers (TensorBoard, W&B: log ``handle.metrics``, usually on rank 0 only).
            Exceptions it raises are logged and ignored.
    """

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # may hold credentials
    keep_last: int | None = None
    on_error: OnError = "warn"
    overlap_copy: bool = True
    fsync: bool = True
    direct_io: bool = True
    exact_bytes: bool = False
    commit_timeout_s: float = 1800.0
    wait_timeout_s: float | None = None
    part_size: int = 16 * MiB
    equal_parts: bool = False
    max_concurrency: int = 8
    upload_threads: int = 4
    cache_dir: str = field(default_factory=default_cache_dir)
    retry_attempts: int = 6
    retry_base_delay_s: float = 0.2
    verify_on_load: bool = True
    keep_every: int | None = None
    writer_nice: int = 0
    overwrite_tags: bool = False
    synchronous: bool | None = None
    local_tier: str | None = None
    local_keep_last: int = 2
    local_tier_max_bytes: int | None = None
    on_save_done: Callable[["SaveHandle"], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", _path_text("url", self.url, "a non-empty path or fsspec URL"))
        if local_path(self.url) == "":
            raise ConfigError(f"url {self.url!r} names no folder (it would be the working directory); write the "
                              "folder after the scheme, e.g. file:///data/ckpt")
        if self.storage_options is None:
            object.__setattr__(self, "storage_options", {})
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"storage_options must be a dict, got {type(self.storage_options).__name__}")
        if local_path(self.url) is not None:
            if any(v is not None for v in self.storage_options.values()):
                raise ConfigError(f"storage_options {sorted(self.storage_options)} are for an object store, but url "
                                  f"{self.url!r} is a local path, where they would be ignored: write the URL with its "
                                  "scheme (s3://bucket/run1), or drop storage_options")
            # options left unset ({"endpoint_url": os.environ.get(...)} where it is not set) mean none
            object.__setattr__(self, "storage_options", {})
        if self.keep_last is not None:
            _integer("keep_last", self.keep_last, 1)
        if self.on_error not in ("warn", "raise"):
            raise ConfigError(f"on_error must be 'warn' or 'raise', got {self.on_error!r}")
        _number("commit_timeout_s", self.commit_timeout_s, minimum=0, exclusive=True)
        if self.wait_timeout_s is not None:
            _number("wait_timeout_s", self.wait_timeout_s, minimum=0, exclusive=True)
        if not 5 * MiB <= _integer("part_size", self.part_size) <= MAX_PART_SIZE:
            raise ConfigError(f"part_size must be from 5 MiB to 5 GiB (S3's smallest and largest part), got "
                              f"{self.part_size!r}")
        _integer("max_concurrency", self.max_concurrency, 1, 256)
        _integer("upload_threads", self.upload_threads, 1, 64)
        _integer("retry_attempts", self.retry_attempts, 1)
        _number("retry_base_delay_s", self.retry_base_delay_s, minimum=0)
        if self.keep_every is not None:
            _integer("keep_every", self.keep_every, 1)
            if self.keep_last is None:
                raise ConfigError(f"keep_every={self.keep_every} protects tags from keep_last's retention, but "
                                  "keep_last is unset, so every tag is kept anyway: set keep_last too, or leave "
                                  "keep_every unset")
        _integer("writer_nice", self.writer_nice, 0, 19)
        for name in ("overlap_copy", "fsync", "direct_io", "exact_bytes", "verify_on_load",
                     "overwrite_tags", "equal_parts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.synchronous is not None and not isinstance(self.synchronous, bool):
            raise ConfigError(f"synchronous must be True, False or None (chosen at wrap), got {self.synchronous!r}")
        if self.on_save_done is not None and not callable(self.on_save_done):
            raise ConfigError(f"on_save_done must be a callable taking the SaveHandle, got {self.on_save_done!r}")
        if self.local_tier is not None:
            self._check_local_tier()
        _integer("local_keep_last", self.local_keep_last, 1)
        if self.local_tier_max_bytes is not None:
            _integer("local_tier_max_bytes", self.local_tier_max_bytes, 1)
            if self.local_tier is None:
                raise ConfigError("local_tier_max_bytes limits a local tier, but local_tier is unset: set local_tier "
                                  "too, or leave local_tier_max_bytes unset")
        if self.synchronous and self.local_tier is not None:
            raise ConfigError("synchronous=True makes every save wait until it is committed at url, so local_tier "
                              "would shorten no save: drop one of them")
        cache_dir = local_path(_path_text("cache_dir", self.cache_dir, "a local folder path"))
        if not cache_dir:  # a URL, or file:// naming no folder
            raise ConfigError(f"cache_dir must be a local folder path, not a URL, got {self.cache_dir!r}")
        object.__setattr__(self, "cache_dir", os.path.abspath(os.path.expanduser(cache_dir)))

    @property
    def effective_wait_timeout_s(self) -> float:
        """``wait_timeout_s``, or where it is unset its default from ``commit_timeout_s``.

        Derived on each read rather than stored at construction, so that a copy made with
        ``dataclasses.replace(config, commit_timeout_s=...)`` gets the default of its own
        ``commit_timeout_s``, not the original's.
        """
        if self.wait_timeout_s is not None:
            return float(self.wait_timeout_s)
        return min(_LONGEST_S, max(_SHORTEST_DEFAULT_WAIT_S, 2 * float(self.commit_timeout_s) + _WAIT_MARGIN_S))

    def _check_local_tier(self) -> None:
        """A local folder apart from ``url``: the tiers keep manifests and ``latest`` of their own."""
        path = local_path(_path_text("local_tier", self.local_tier, "a local folder path"))
        if path is None:
            raise ConfigError(f"local_tier must be a node-local folder (NVMe, /dev/shm), not a URL: "
                              f"{self.local_tier!r}; put the object store in url")
        if not path:
            raise ConfigError(f"local_tier {self.local_tier!r} names no folder (it would be the working directory); "
                              "write the folder after the scheme, e.g. file:///nvme/ckpt")
        path = os.path.abspath(os.path.expanduser(path))
        object.__setattr__(self, "local_tier", path)
        url_path = local_path(self.url)
        if url_path is not None:
            durable = os.path.abspath(os.path.expanduser(url_path))
            if os.path.commonpath([path, durable]) in (path, durable):
                raise ConfigError(f"local_tier {path!r} and url {durable!r} overlap; each tier needs a folder of its "
                                  "own (each keeps its own manifests and 'latest')")


def _path_text(name: str, value: Any, what: str) -> str:
    """``value`` (a str or path) as text, if it is not empty and has no surrounding whitespace (which would
    name another folder than meant); else :class:`ConfigError` naming the field and ``what`` it must be."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text.strip() or text != text.strip():
        raise ConfigError(f"{name} must be {what}, with no surrounding whitespace, got {value!r}")
    return text


def local_path(url: str) -> str | None:
    """The local path ``url`` names (a plain path, ``file://`` or ``local://``, as open_storage takes them), or
    ``None`` for any other URL."""
    for scheme in ("file://", "local://"):
        if url.startswith(scheme):
            return url[len(scheme):]
    return None if "://" in url else url


def _integer(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) within the bounds; else :class:`ConfigError` naming the field."""
    bounds = (f" in {minimum}..{maximum}" if maximum is not None else f" >= {minimum}" if minimum is not None else "")
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum) \
            or (maximum is not None and value > maximum):
        raise ConfigError(f"{name} must be an integer{bounds}, got {value!r}")
    return value


def timeout_argument(name: str, value: Any) -> float | None:
    """A call's ``timeout`` (``wait(timeout=...)``): ``None``, or seconds >= 0 (infinity: no limit); else
    :class:`ConfigError` naming it, before the wait (a NaN would never run out, a string fail mid-wait)."""
    if value is None or value == float("inf"):
        return value
    return _number(name, value, minimum=0)


def _number(name: str, value: Any, *, minimum: float, exclusive: bool = False) -> float:
    """``value`` if it is a real number (not a bool) above ``minimum`` and at most ``_LONGEST_S``; else
    :class:`ConfigError`. Every number here is a duration, and the waits it sets become timedeltas and
    thread joins, which overflow on infinity or on a huge finite value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or (value <= minimum if exclusive else value < minimum) or value > _LONGEST_S:
        raise ConfigError(f"{name} must be a number {'>' if exclusive else '>='} {minimum:g} and at most "
                          f"{_LONGEST_S:g} s, got {value!r}")
    return float(value)
