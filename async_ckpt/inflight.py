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
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from async_ckpt.checkpointer import AsyncCheckpointer

_OPEN: "weakref.WeakSet[AsyncCheckpointer]" = weakref.WeakSet()
_LOCK = threading.Lock()
_HOOKED = False


def register(checkpointer: "AsyncCheckpointer") -> None:
    """Track an open checkpointer (dropped when closed or collected); hook DeepSpeed's readers once."""
    global _HOOKED
    with _LOCK:
        _OPEN.add(checkpointer)
        if not _HOOKED:
            _hook_deepspeed_readers()
            _HOOKED = True


def unregister(checkpointer: "AsyncCheckpointer") -> None:
    with _LOCK:
        _OPEN.discard(checkpointer)


def wait_all(timeout: float | None = None) -> None:
    """Block until every save of every open checkpointer in this process is committed or failed.

    Each checkpointer waits as its ``wait()`` does (a failure is raised with ``on_error="raise"``,
    logged otherwise), together at most ``timeout`` seconds (default: each one's
    ``wait_timeout_s``), then :class:`~async_ckpt.WaitTimeoutError` names the rank and the tag.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with _LOCK:
        open_now = list(_OPEN)
    for checkpointer in open_now:
        checkpointer.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _waiting_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        wait_all()
        return fn(*args, **kwargs)

    hooked.__wrapped_by_async_ckpt__ = True  # type: ignore[attr-defined]
    return hooked


def _hook(owner: Any, name: str) -> None:
    """Replace ``owner.name`` with a version that waits first; for a module function, rebind too every
    module that took the function with ``from ... import`` before (a test or script imported earlier)."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "__wrapped_by_async_ckpt__", False):
        return
    hooked = _waiting_first(original)
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
