"""Storage backends, one per module, chosen from the destination URL by :func:`open_storage`."""

from __future__ import annotations

import re
from typing import Any, Mapping

import fsspec
from fsspec.core import split_protocol

from async_ckpt.errors import ConfigError
from async_ckpt.storage.base import Storage
from async_ckpt.storage.fsspec_store import FsspecStorage
from async_ckpt.storage.local import LocalStorage
from async_ckpt.storage.retry import RetryPolicy

__all__ = ["Storage", "FsspecStorage", "LocalStorage", "RetryPolicy", "open_storage"]

_LOCAL_PROTOCOLS = (None, "file", "local")


_MALFORMED_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/?(?!/)")


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None, *, fsync: bool = True,
                 direct_io: bool = True,
                 part_size: int | None = None, equal_parts: bool = False, max_concurrency: int | None = None,
                 upload_threads: int | None = None, retry: RetryPolicy | None = None) -> Storage:
    """The backend for ``url``: local/NFS paths, ``s3://``, or any other fsspec protocol."""
    if _MALFORMED_URL.match(url) and "://" not in url:
        raise ConfigError(f"{url!r} looks like a malformed URL; write it as scheme://bucket/path (e.g. s3://bucket/run1)")
    protocol, path = split_protocol(url)
    options = dict(storage_options or {})
    if protocol in _LOCAL_PROTOCOLS:
        if options:
            raise ConfigError(f"storage_options {sorted(options)} do not apply to the local path {url!r}")
        return LocalStorage(path, fsync=fsync, direct_io=direct_io)
    if not path or not path.strip("/"):
        raise ConfigError(f"URL {url!r} names no bucket or folder; use e.g. {protocol}://bucket/run1")
    magic = sorted(set(path) & set("*?[]"))
    if magic:  # fsspec reads them as a glob when it deletes or moves: a root 'run[1]' would delete 'run1/...'
        raise ConfigError(f"URL {url!r} holds {' '.join(magic)}, which fsspec takes for a glob pattern when it "
                          "deletes or moves objects (retention and gc would act on other folders); name the root "
                          "without * ? [ ]")
    if protocol in ("s3", "s3a"):
        from async_ckpt.storage.s3 import S3Storage

        return S3Storage(url, options, part_size=part_size, equal_parts=equal_parts, max_concurrency=max_concurrency,
                         upload_threads=upload_threads, retry=retry)
    try:
        fs_cls = fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"cannot open {url!r}: {exc}. Install the fsspec backend for "
                          f"'{protocol}://' or fix the URL") from exc
    try:  # what the URL itself says (a host and port, an account), under what storage_options say
        fs = fs_cls(**{**fs_cls._get_kwargs_from_urls(url), **options})
    except TypeError as exc:
        raise ConfigError(f"storage_options for {protocol}:// are invalid: {exc}") from exc
    except ImportError as exc:  # a backend that imports its client library only when first opened (hdfs)
        raise ConfigError(f"cannot open {url!r}: {exc}. Install what the fsspec backend for '{protocol}://' "
                          "needs") from exc
    return FsspecStorage(fs, fs_cls._strip_protocol(url), url)
