"""Saves in flight in this process, and the wait that readers of a checkpoint folder need.

``save()`` returns before the files exist. Code in the same process that reads the folder right
after (a new engine's ``load_checkpoint``, ``ds_to_universal``, ``zero_to_fp32``, an evaluation
script) would find a folder without the new tag, or without ``latest``. :func:`wait_all` waits for
every save of every open checkpointer of the process. The first ``wrap()`` hooks DeepSpeed's own
readers to call it first: ``DeepSpeedEngine.load_checkpoint`` (whichever engine loads),
``ds_to_universal``'s ``main`` and ``zero_to_fp32``'s consolidation functions. The hooks are no-ops
while nothing is in flight. A module that took one of those functions with ``from ... import`` before
the first ``wrap()`` is rebound to the hooked function then; a reference kept in any other place
(a local variable, a dict) is not: call :func:`wait_all` before using it.

A save also needs its process to live until the commit: the commit goes through the job's c10d
store (``handshake.py``), and the background writer is a daemon thread. So the first ``wrap()``
also makes two ends of a rank wait for its saves in flight:

- ``torch.distributed.destroy_process_group`` of the default group waits first (so does
  ``deepspeed.comm.destroy_process_group``, which looks it up on ``torch.distributed`` at each
  call): destroying the group drops the store the commit still uses. Destroying a subgroup does not
  wait (training code may do that between steps).
- the process's exit waits (each checkpointer at most its ``wait_timeout_s``, as ``close()``), logs
  what it waits for and any failure, and never raises. A multiprocessing child (DeepSpeed's test
  pool workers, ``torch.multiprocessing.spawn`` ranks) ends through ``os._exit`` without running
  ``atexit``; the one exit path both it and a normal interpreter exit take is
  ``threading._shutdown``, whose callbacks (``threading._register_atexit``) run before the
  interpreter refuses new work to thread pools (``concurrent.futures`` registers its own refusal
  there, earlier, so it runs after ours) -- the writer's O_DIRECT and S3 helpers need those pools.
  ``atexit`` and ``multiprocessing.util.Finalize`` run after that refusal in a main process.
  A forked child (a DataLoader worker) forgets its parent's checkpointers: their writer threads
  are not in it, and its exit must not wait for them.

On a thread inside :func:`not_waiting` the readers' hooks do not wait: async_ckpt's own ``load()`` (it
settled the saves it reads first; a tiered load leaves drains running, which a ZeRO-3 load without
optimizer states, reading through ``zero_to_fp32``, would wait out; an explicit wait there returns at
once), and an ``on_save_done`` callback, which runs on the writer or drainer thread: the saves a wait
there would wait for are written by that very thread once the callback returns, so an explicit wait
(:func:`wait_all`, a checkpointer's ``wait()``, ``close()``, a synchronous ``save()``) raises there.

What still loses a save in flight: ``os._exit``, a signal that kills the process (SIGKILL, an
unhandled SIGTERM), and a wait that times out.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 (registers its exit hook before ours: see the docstring)
import contextlib
import functools
import logging
import os
import sys
import threading
import time
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch.distributed as dist

from async_ckpt.config import timeout_argument
from async_ckpt.errors import UsageError, WaitTimeoutError

if TYPE_CHECKING:
    from async_ckpt.checkpointer import AsyncCheckpointer

logger = logging.getLogger("async_ckpt")

_OPEN: "weakref.WeakSet[AsyncCheckpointer]" = weakref.WeakSet()
_LOCK = threading.Lock()
_HERE = threading.local()  # .inside: (refusal,) while this thread must not wait for saves (see not_waiting)
#: Where an ``on_save_done`` callback runs (its :func:`not_waiting`).
IN_ON_SAVE_DONE = "in an on_save_done callback, which runs on async_ckpt's writer or drainer thread"
_HOOKED = False


def register(checkpointer: "AsyncCheckpointer") -> None:
    """Track an open checkpointer (dropped when closed or collected); once, hook DeepSpeed's readers,
    the process group's destruction and the process's exit."""
    global _HOOKED
    with _LOCK:
        _OPEN.add(checkpointer)
        if not _HOOKED:
            _hook_deepspeed_readers()
            _hook(dist, "destroy_process_group", only_if=_ends_the_default_group, even_if_waiting_fails=True)
            threading._register_atexit(_wait_at_exit)  # type: ignore[attr-defined]
            os.register_at_fork(after_in_child=_OPEN.clear)
            _HOOKED = True


def unregister(checkpointer: "AsyncCheckpointer") -> None:
    with _LOCK:
        _OPEN.discard(checkpointer)


@contextlib.contextmanager
def not_waiting(refusal: str | None = None) -> Iterator[None]:
    """Inside the block, on this thread, the hooked readers read without waiting for saves, and an explicit
    wait (:func:`waits_here`) returns at once, or with ``refusal`` (where the thread is) raises
    :class:`~async_ckpt.UsageError` saying so: see the module docstring."""
    outer = getattr(_HERE, "inside", None)
    _HERE.inside = (refusal,)
    try:
        yield
    finally:
        _HERE.inside = outer


def waits_here(call: str) -> bool:
    """Whether ``call``, a wait for saves, waits on this thread: not inside :func:`not_waiting`, where it
    returns at once, or raises :class:`~async_ckpt.UsageError` naming ``call`` where the block refuses waits."""
    inside = getattr(_HERE, "inside", None)
    if inside is None:
        return True
    if inside[0] is not None:
        raise UsageError(f"{call}: called {inside[0]}, it would wait for saves this thread has yet to write. Wait "
                         "from the training loop instead")
    return False


def wait_all(timeout: float | None = None) -> None:
    """Block until every save of every open checkpointer in this process is committed or failed.

    Each checkpointer waits as its ``wait()`` does (a failure is raised with ``on_error="raise"``,
    logged otherwise), together at most ``timeout`` seconds (default: each one's
    ``wait_timeout_s``), then :class:`~async_ckpt.WaitTimeoutError` names the rank and the tag.
    """
    timeout = timeout_argument("wait_all(timeout=...)", timeout)
    if not waits_here("wait_all()"):
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    with _LOCK:
        open_now = list(_OPEN)
    for checkpointer in open_now:
        checkpointer.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _wait_at_exit() -> None:
    """Let every save in flight commit before the process ends, then remove each checkpointer's shadow
    folder (``atexit`` would not, in a multiprocessing child); log, never raise (see the module docstring)."""
    with _LOCK:
        open_now = list(_OPEN)
    for checkpointer in open_now:
        try:
            pending = [f"{handle.url}/{handle.tag}" for handle in checkpointer._handles if not handle.done()]
            if not pending:
                continue
            logger.info("rank %d: the process is exiting with saves in flight; waiting for their commit (at most "
                        "%.0f s): %s", checkpointer.rank, checkpointer.config.effective_wait_timeout_s, ", ".join(pending))
            try:
                checkpointer.wait()
            except Exception as exc:  # raised with on_error="raise", or WaitTimeoutError
                logger.error("rank %d: a save in flight at exit did not commit: %s: %s", checkpointer.rank,
                             type(exc).__name__, exc)
            except KeyboardInterrupt:
                logger.error("rank %d: interrupted at exit; saves still in flight are lost: %s", checkpointer.rank,
                             ", ".join(pending))
                return
        finally:
            checkpointer._remove_shadow()


def _ends_the_default_group(group: Any = None) -> bool:
    """``destroy_process_group(group)`` destroys the default group (and with it the job's store)."""
    return group is None or group == dist.GroupMember.WORLD


def _waiting_first(fn: Callable[..., Any], only_if: Callable[..., bool] | None = None, *,
                   even_if_waiting_fails: bool = False) -> Callable[..., Any]:
    """``fn`` that waits for every save first. With ``even_if_waiting_fails``, ``fn`` runs where the wait
    raises a save's failure too, before that error is raised: a script's ``finally:
    destroy_process_group()`` must still end the group. Not after a timeout: a save still going needs
    the group's store to commit, which the exit's own wait then gives it."""
    @functools.wraps(fn)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        if getattr(_HERE, "inside", None) is None and (only_if is None or only_if(*args, **kwargs)):
            try:
                wait_all()
            except Exception as exc:
                if even_if_waiting_fails and not isinstance(exc, WaitTimeoutError):
                    fn(*args, **kwargs)
                raise
        return fn(*args, **kwargs)

    hooked.__wrapped_by_async_ckpt__ = True  # type: ignore[attr-defined]
    return hooked


def _hook(owner: Any, name: str, only_if: Callable[..., bool] | None = None, *,
          even_if_waiting_fails: bool = False) -> None:
    """Replace ``owner.name`` with a version that waits first (when ``only_if(*args, **kwargs)``, if given);
    for a module function, rebind too every module that took the function with ``from ... import``
    before (a test or script imported earlier)."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "__wrapped_by_async_ckpt__", False):
        return
    hooked = _waiting_first(original, only_if, even_if_waiting_fails=even_if_waiting_fails)
    setattr(owner, name, hooked)
    if isinstance(owner, types.ModuleType):
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, "__dict__", {}).get(name) is original:
                setattr(module, name, hooked)


def _hook_deepspeed_readers() -> None:
    """``main`` of ds_to_universal is hooked through the first module function it calls, so that a
    ``from ds_to_universal import main`` taken earlier waits too."""
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import zero_to_fp32

    _hook(DeepSpeedEngine, "load_checkpoint")
    _hook(ds_to_universal, "_get_optim_files")
    for name in ("get_fp32_state_dict_from_zero_checkpoint", "_get_fp32_state_dict_from_zero_checkpoint"):
        _hook(zero_to_fp32, name)
