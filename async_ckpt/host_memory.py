"""Host memory for staging: anonymous mappings faulted in ahead of use, trimmed, and pinned for CUDA.

Staging lives in anonymous mappings (:func:`~async_ckpt.storage.base.anonymous_memory`, the one kind of
memory every ``O_DIRECT`` write reads from) rather than allocator memory because a buffer must sit at an
address of the staging pool's choosing (aligned like its file offset, for ``O_DIRECT`` writes with
no copy) and the memory must be reserved long before the first save. On CUDA the same mappings are
page-locked with ``cudaHostRegister`` instead of allocated with ``cudaHostAlloc``: the device-to-host
copies into them are then asynchronous DMA, and pinning can run in the background from ``wrap()``,
so the first save neither allocates nor pins.

Faulting in and pinning gigabytes take seconds, and release the GIL while they do; the staging pool
runs them on its helper thread.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

from async_ckpt.storage.base import buffer_address

logger = logging.getLogger("async_ckpt")

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without writing them
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process, not just the caller's


def populate(mapping: mmap.mmap) -> None:
    """Fault in every page of ``mapping``: ``madvise`` where the kernel can, else by zero-filling it
    through torch. Both release the GIL (ctypes calls and torch kernels do)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(buffer_address(mapping), len(mapping), _MADV_POPULATE_WRITE) != 0:
        torch.frombuffer(mapping, dtype=torch.uint8).zero_()


def release_tail(mapping: mmap.mmap, start: int) -> None:
    """Give the pages of ``mapping`` from ``start`` (a page boundary before its end) back to the system."""
    mapping.madvise(mmap.MADV_DONTNEED, start, len(mapping) - start)


def register(mapping: mmap.mmap, length: int, device: torch.device) -> str | None:
    """``cudaHostRegister`` the first ``length`` bytes of ``mapping``; the error, or ``None``.

    The device is made current only for the call (the runtime registers in the current context; a
    thread's default, GPU 0, would open a context there for every rank). The pages are left out of
    forked children (DataLoader workers): shared copy-on-write with a child, they could be moved to
    new pages that the device does not write to.
    """
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    try:
        mapping.madvise(mmap.MADV_DONTFORK, 0, length)
        with torch.cuda.device(device):
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostRegister(buffer_address(mapping), length, _CUDA_HOST_REGISTER_PORTABLE)
            if error == cudart.cudaError.success:
                return None
            failure = str(cudart.cudaGetErrorString(error))
        mapping.madvise(mmap.MADV_DOFORK, 0, length)
        return failure
    except (OSError, RuntimeError) as exc:
        return str(exc)


def unregister(address: int, device: torch.device) -> str | None:
    """``cudaHostUnregister`` the memory :func:`register` pinned at ``address``; the error, or ``None``."""
    try:
        with torch.cuda.device(device):
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostUnregister(address)
            return None if error == cudart.cudaError.success else str(cudart.cudaGetErrorString(error))
    except RuntimeError as exc:
        return str(exc)


class PinnedMappings:
    """The mappings a staging pool has pinned, to be unpinned before their pages go back to the system
    (locked pages stay locked for the life of the process if their mapping is unmapped while pinned).

    It holds each mapping it pinned, so none is unmapped before :meth:`unpin` or :meth:`unpin_all`. Not
    thread-safe: the pool calls it from its helper thread, or from another while the helper is idle.
    """

    def __init__(self) -> None:
        self._pinned: dict[int, tuple[mmap.mmap, torch.device]] = {}

    def __contains__(self, mapping: mmap.mmap) -> bool:
        return buffer_address(mapping) in self._pinned

    def pin(self, mapping: mmap.mmap, length: int, device: torch.device) -> None:
        """Pin ``mapping``'s first ``length`` bytes for copies from ``device``. A failure is logged, not
        raised: the memory stays usable, its copies are then synchronous (the stall grows)."""
        address = buffer_address(mapping)
        error = register(mapping, length, device)
        if error is None:
            self._pinned[address] = (mapping, device)
            logger.debug("pinned %d bytes of staging memory for copies from %s", length, device)
            return
        logger.warning("could not pin %d bytes of staging memory for copies from %s (%s): the copies into it are "
                       "synchronous, so saves stall longer; pinning needs that much free host memory and a "
                       "locked-memory limit above it (ulimit -l, a container's memlock)", length, device, error)

    def unpin(self, mapping: mmap.mmap) -> None:
        """Unpin ``mapping`` (once no copy into it is in flight); it may then be pinned again."""
        address = buffer_address(mapping)
        if address in self._pinned:
            self._unpin(address)

    def unpin_all(self) -> None:
        """Unpin everything (once no copy is in flight)."""
        for address in list(self._pinned):
            self._unpin(address)

    def _unpin(self, address: int) -> None:
        """Unpin and forget one mapping; a failure is logged (nothing else could undo it)."""
        _, device = self._pinned.pop(address)
        error = unregister(address, device)
        if error is not None:
            logger.warning("could not unpin %#x, staging memory pinned for copies from %s (%s): its pages may "
                           "stay locked until the process ends", address, device, error)
