"""Staging memory: private anonymous mappings that give trimmed pages back, share nothing with a forked
child, and sit on transparent huge pages where the kernel has them (:func:`async_ckpt.storage.base.anonymous_memory`).

Linux merges neighbouring mappings with the same flags into one memory area, and ``/proc/self/smaps``
reports areas: so each test reads its area before and after, and judges the difference.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from async_ckpt import host_memory
from async_ckpt.storage.base import _MADV_WIPEONFORK, anonymous_memory, buffer_address

MiB = 1024 * 1024
_PR_GET_THP_DISABLE = 42


def _area(mapping: mmap.mmap) -> dict[str, str]:
    """The ``/proc/self/smaps`` fields of the memory area that holds ``mapping``."""
    address, inside, fields = buffer_address(mapping), False, {}
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # the next area: "low-high perms offset device inode [path]"
                if inside:
                    return fields
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside:
                fields[head[:-1]] = line.partition(":")[2].strip()
    if inside:
        return fields
    raise AssertionError(f"no memory area holds {address:#x}")


def _kib(mapping: mmap.mmap, field: str) -> int:
    return int(_area(mapping)[field].split()[0])


def _kernel_takes(advice: int) -> bool:
    with mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as probe:
        try:
            probe.madvise(advice)
        except OSError:
            return False
    return True


def _huge_pages_unavailable() -> str | None:
    """Why this process cannot get transparent huge pages, or ``None``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            enabled = setting.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "this kernel has no transparent huge pages"
    if enabled not in ("always", "madvise"):
        return f"transparent huge pages are {enabled!r} on this machine"
    if ctypes.CDLL(None).prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1:
        return "transparent huge pages are disabled for this process (PR_SET_THP_DISABLE)"
    return None


def _huge_page_bytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as size:
            return int(size.read())
    except OSError:
        return 2 * MiB


def test_trimmed_staging_pages_go_back_to_the_system():
    mapping = anonymous_memory(64 * MiB)
    before = _kib(mapping, "Anonymous")  # private memory; shmem (a shared mapping) is never "Anonymous"
    host_memory.populate(mapping)
    populated = _kib(mapping, "Anonymous")
    host_memory.release_tail(mapping, 16 * MiB)
    trimmed = _kib(mapping, "Anonymous")
    mapping.close()
    assert populated - before >= 64 * 1024
    assert trimmed - before <= 16 * 1024 + 2048  # a huge page split at the cut may keep a little


#: The advice anonymous_memory gives, and the flag each leaves in smaps' VmFlags, where the kernel takes it.
_ADVICE_FLAGS = {"hg": getattr(mmap, "MADV_HUGEPAGE", -1), "wf": _MADV_WIPEONFORK}


@pytest.mark.skipif(not any(_kernel_takes(advice) for advice in _ADVICE_FLAGS.values()),
                    reason="this kernel takes neither MADV_HUGEPAGE nor MADV_WIPEONFORK")
def test_staging_memory_is_advised_for_huge_pages_and_wiped_in_forked_children():
    mapping = anonymous_memory(4 * MiB)
    flags = _area(mapping)["VmFlags"].split()
    mapping.close()
    expected = {flag for flag, advice in _ADVICE_FLAGS.items() if _kernel_takes(advice)}
    assert expected <= set(flags)


@pytest.mark.skipif(not _kernel_takes(_MADV_WIPEONFORK), reason="this kernel has no MADV_WIPEONFORK (Linux 4.14+)")
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


@pytest.mark.skipif(_huge_pages_unavailable() is not None, reason=str(_huge_pages_unavailable()))
def test_staging_memory_sits_on_huge_pages_where_the_kernel_has_them():
    mapping = anonymous_memory(16 * _huge_page_bytes())
    before = _kib(mapping, "AnonHugePages")
    host_memory.populate(mapping)
    huge = _kib(mapping, "AnonHugePages") - before
    mapping.close()
    assert huge > 0
