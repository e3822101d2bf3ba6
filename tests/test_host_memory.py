"""Staging memory: private anonymous mappings that give trimmed pages back, share nothing with a forked
child, and sit on transparent huge pages where the kernel has them (:func:`async_ckpt.storage.base.anonymous_memory`)."""

from __future__ import annotations

import mmap
import os

import pytest

from async_ckpt import host_memory
from async_ckpt.storage.base import anonymous_memory, buffer_address

MiB = 1024 * 1024


def _smaps_kib(mapping: mmap.mmap, field: str) -> int:
    """``field`` (``Rss``, ``AnonHugePages``...) of the memory area that holds ``mapping``, in KiB."""
    address, inside = buffer_address(mapping), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            name, *rest = line.split()
            if "-" in name and len(rest) >= 4:
                low, high = (int(x, 16) for x in name.split("-"))
                inside = low <= address < high
            elif inside and name == f"{field}:":
                return int(rest[0])
    raise AssertionError(f"no memory area holds {address:#x}")


def _kernel_takes(advice: int) -> bool:
    with mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as probe:
        try:
            probe.madvise(advice)
        except OSError:
            return False
    return True


def _transparent_huge_pages() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return setting.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def test_trimmed_staging_pages_go_back_to_the_system():
    mapping = anonymous_memory(64 * MiB)
    host_memory.populate(mapping)
    assert _smaps_kib(mapping, "Anonymous") >= 64 * 1024  # private memory: shmem is never "Anonymous"
    host_memory.release_tail(mapping, 16 * MiB)
    assert _smaps_kib(mapping, "Anonymous") <= 16 * 1024 + 2048  # a huge page split at the cut may keep a little
    mapping.close()


@pytest.mark.skipif(not _kernel_takes(18), reason="this kernel has no MADV_WIPEONFORK (Linux 4.14+)")
def test_a_forked_child_sees_zeros_where_the_parent_staged_bytes():
    mapping = anonymous_memory(4 * MiB)
    mapping[:8] = b"weights!"
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the child reports what it sees, and leaves without running the parent's cleanup
        os.write(writer, bytes(mapping[:8]))
        os._exit(0)
    os.close(writer)
    seen = os.read(reader, 8)
    os.waitpid(child, 0)
    os.close(reader)
    assert seen == bytes(8) and mapping[:8] == b"weights!"
    mapping.close()


@pytest.mark.skipif(_transparent_huge_pages() not in ("always", "madvise"),
                    reason=f"transparent huge pages are {_transparent_huge_pages()!r} on this kernel")
def test_staging_memory_sits_on_huge_pages_where_the_kernel_has_them():
    mapping = anonymous_memory(64 * MiB)
    host_memory.populate(mapping)
    assert _smaps_kib(mapping, "AnonHugePages") > 0
    mapping.close()
