"""A persistent group of local ranks for demos, benchmarks and tests.

It ships in the package because ``async-ckpt demo`` and ``async-ckpt bench`` start their ranks with
it at run time; the test suite uses it too.

Starting a DeepSpeed rank costs seconds (process start, ``init_distributed``, imports), so the
group starts its processes once and then runs any number of picklable functions on every rank.
If one rank fails while the others wait in a collective, the whole group is torn down and the
error (with the failing rank's traceback) is raised in the caller.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator, Mapping

from async_ckpt.errors import AsyncCkptError


class RankError(AsyncCkptError):
    """A function failed, hung or died on one of the ranks; ``partial`` holds the others' answers."""

    def __init__(self, message: str, *, partial: dict[int, Any] | None = None) -> None:
        super().__init__(message)
        self.partial = dict(partial or {})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend_for(accelerator: str) -> str:
    """The process-group backend for a DeepSpeed accelerator: NCCL between GPUs, gloo on CPU."""
    return "nccl" if accelerator == "cuda" else "gloo"


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the duration: what a process spawned meanwhile is born with."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: Sent to a rank that does not answer in time: it writes every thread's stack to its stack file.
STACK_DUMP_SIGNAL = signal.SIGUSR1


#: What this process's fork server imported, and for which accelerator (see ``RankGroup(preload=...)``).
_preloaded: tuple[tuple[str, ...], str] | None = None


def _start_preloading_server(modules: tuple[str, ...], accelerator: str) -> None:
    """Start multiprocessing's fork server (one per process), importing ``modules`` once for every rank it forks.

    DeepSpeed picks its accelerator at import, so the server is started with the group's
    ``DS_ACCELERATOR``, and a later group that asks for other modules or another accelerator is
    refused: its ranks would silently run with the first group's.
    """
    global _preloaded
    if _preloaded is None:
        with _environment({"DS_ACCELERATOR": accelerator}):
            mp.get_context("forkserver").set_forkserver_preload(list(modules))
            multiprocessing.forkserver.ensure_running()
        _preloaded = (modules, accelerator)
    elif _preloaded != (modules, accelerator):
        raise ValueError(f"RankGroup(preload={modules!r}) for accelerator '{accelerator}': this process's fork "
                         f"server already imported {_preloaded[0]!r} for '{_preloaded[1]}', and there is one per "
                         "process; pass the same preload list and accelerator, or preload=() for spawned ranks")


#: How often a rank without ``pidfd_open`` checks that the process that started it is still there.
ORPHAN_CHECK_S = 1.0


def _exit_when_orphaned(owner: int, spawned: bool) -> None:
    """End this rank once ``owner``, the process that made its group, is gone.

    An owner that dies without closing its group (``kill``, ``pkill``: Python runs no ``finally`` on
    SIGTERM) would otherwise leave its ranks waiting for tasks, or training on, for ever, taking the
    CPU and disk of whatever runs next. The owner is watched through a pidfd (Linux 5.3+), not through
    this process's parent: a preloaded rank's parent is multiprocessing's fork server, which lives on
    as long as any process it forked does. A spawned rank's parent is the owner, so a changed parent id
    also tells it the owner is gone (and, checked after the pidfd is opened, that the pidfd is not a
    later process's under a reused id); without pidfds it polls that instead, and a preloaded one is not
    watched. A process that forks, hands the group to its child and exits ends the group's ranks too.
    """
    def adopted() -> bool:
        return spawned and os.getppid() != owner

    try:
        pidfd = None if adopted() else os.pidfd_open(owner)
    except ProcessLookupError:
        pidfd = None  # gone before this rank started
    except (AttributeError, OSError):  # no pidfds on this system
        if not spawned:
            return
        while not adopted():
            time.sleep(ORPHAN_CHECK_S)
        pidfd = None
    if pidfd is not None and not adopted():
        watch = select.poll()
        watch.register(pidfd, select.POLLIN)
        watch.poll()  # readable once the owner has exited
    print(f"async_ckpt rank {os.environ.get('RANK', '?')}: the process that started its group (pid {owner}) is "
          "gone; exiting", file=sys.stderr, flush=True)
    for child in mp.active_children():  # processes of this rank's own (DeepSpeed's decoupled writer)
        child.kill()
    os._exit(1)


def _worker(tasks: Any, results: Any, owner: int, environ: dict[str, str] | None = None) -> None:
    # not named async_ckpt-*: it is the launcher's, for the rank's life, not a checkpointer's (closed with it)
    threading.Thread(target=_exit_when_orphaned, args=(owner, environ is None), name="rank-orphan-watch",
                     daemon=True).start()
    if environ is not None:  # forked by the preloading server: this group's environment, as a spawned rank is born with
        os.environ.clear()
        os.environ.update(environ)
        tempfile.tempdir = None
    rank = int(os.environ["RANK"])
    stacks = open(os.environ["ASYNC_CKPT_STACK_FILE"], "w")  # noqa: SIM115 (open for the life of the rank)
    faulthandler.register(STACK_DUMP_SIGNAL, file=stacks, all_threads=True)
    try:
        import deepspeed

        timeout = datetime.timedelta(seconds=float(os.environ.get("ASYNC_CKPT_PG_TIMEOUT_S", "300")))
        deepspeed.init_distributed(dist_backend=backend_for(os.environ["DS_ACCELERATOR"]), timeout=timeout)
        results.put((rank, True, bytes(ForkingPickler.dumps(None))))  # as every answer: pickled here
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            result = fn(*args, **kwargs)
            try:  # here, not by the queue: its feeder thread drops what fails, and the caller would wait in vain
                pickled = bytes(ForkingPickler.dumps(result))
            except Exception as exc:
                raise TypeError(f"{getattr(fn, '__name__', fn)} returned a {type(result).__name__}, which cannot be "
                                f"sent back from the rank ({exc}); return plain data") from exc
            results.put((rank, True, pickled))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class RankGroup:
    """``world_size`` local processes joined in one process group, reused across calls.

    The ranks run on DeepSpeed's CPU accelerator over gloo unless ``env`` sets ``DS_ACCELERATOR``
    (``cuda``: one GPU per rank, NCCL).
    """

    def __init__(self, world_size: int = 2, *, env: dict[str, str] | None = None, start_timeout_s: float = 600,
                 daemon: bool = True, preload: tuple[str, ...] = ()) -> None:
        """``daemon=False`` lets rank code start processes of its own (DeepSpeed's decoupled writer).

        ``preload`` (e.g. ``("deepspeed", "transformers")``): forks every rank
        from one server process that imported these modules once (multiprocessing's ``forkserver``)
        instead of starting a fresh interpreter per rank, which spends seconds of CPU on imports. Each
        rank gets the environment of the moment it starts, as a spawned one does, but the modules
        keep what they read from the environment at import (DeepSpeed's accelerator), so every
        preloading group of a process must name the same modules and ``DS_ACCELERATOR``. The
        test suite, which starts dozens of groups, uses it; ``demo`` and ``bench`` spawn (the bench's
        restarts time a job's real start, imports included).
        """
        accelerator = (env or {}).get("DS_ACCELERATOR") or os.environ.get("DS_ACCELERATOR", "cpu")
        if preload:
            _start_preloading_server(tuple(preload), accelerator)
        ctx = mp.get_context("forkserver" if preload else "spawn")
        self.world_size = world_size
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        # A spawned rank is born with this environment, before it imports DeepSpeed (which picks its
        # accelerator from DS_ACCELERATOR at import); a forked one sets it as the worker's first act,
        # its DeepSpeed imported by the server for the same accelerator.
        common = {**(env or {}), "DS_ACCELERATOR": accelerator,
                  "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        self._stack_dir = tempfile.mkdtemp(prefix="async_ckpt_ranks_")
        self._procs = []
        try:
            for rank in range(world_size):
                with _environment({**common, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                   "ASYNC_CKPT_STACK_FILE": self._stack_file(rank)}):
                    proc = ctx.Process(target=_worker, args=(self._tasks[rank], self._results, os.getpid(),
                                                             dict(os.environ) if preload else None),
                                       name=f"async_ckpt-rank{rank}", daemon=daemon)
                    self._procs.append(proc)
                    proc.start()
            self._collect(start_timeout_s, "start")
        except BaseException:  # a rank that started waits for tasks: a non-daemon one would hold up exit
            self.close(force=True)
            raise

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 900, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout_s, getattr(fn, "__name__", repr(fn)))

    def _collect(self, timeout_s: float, what: str) -> list[Any]:
        """Gather one answer per rank. A rank that dies, fails or hangs tears the whole group down."""
        results: dict[int, Any] = {}
        failure = None
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if r not in results and p.exitcode is not None]
                if dead:
                    failure = failure or f"{what}: rank(s) {dead} died (exit code {self._procs[dead[0]].exitcode})"
                    # give the survivors a moment; none is needed once every live rank has answered
                    everyone = len(results) + len(dead) == self.world_size
                    deadline = min(deadline, time.monotonic() + (0 if everyone else 20))
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(results))
                    stacks = self._stacks(missing)
                    self.close(force=True)
                    message = failure or f"{what}: ranks {missing} did not answer within {timeout_s:.0f} s"
                    raise RankError(message + stacks, partial=results) from None
                continue
            if not ok and failure is None:
                failure = f"{what} failed on rank {rank}:\n{value}"
                deadline = min(deadline, time.monotonic() + 20)  # its peers are likely stuck in a collective
            results[rank] = ForkingPickler.loads(value) if ok else value
        if failure:
            raise RankError(failure, partial=results)
        return [results[r] for r in range(self.world_size)]

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.stacks")

    def _stacks(self, ranks: list[int]) -> str:
        """What the live ranks among ``ranks`` are doing: every thread's stack, for the error (where a hang is)."""
        alive = [r for r in ranks if self._procs[r].is_alive() and self._procs[r].pid]
        for rank in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[rank].pid, STACK_DUMP_SIGNAL)
        text = ""
        for rank in alive:
            path = self._stack_file(rank)
            deadline = time.monotonic() + 5  # faulthandler writes from the signal handler, at once
            while time.monotonic() < deadline and not (os.path.exists(path) and os.path.getsize(path)):
                time.sleep(0.05)
            time.sleep(0.2)
            try:
                with open(path) as fh:
                    text += f"\n--- rank {rank}, which did not answer, was here:\n{fh.read()}"
            except OSError:  # a rank still starting: it had not opened its stack file yet
                text += f"\n--- rank {rank}, which did not answer, was still starting"
        return text

    def close(self, force: bool = False) -> None:
        """Stop the ranks (at once with ``force``, else after their task, at most 60 s) and the queues' threads."""
        for proc, q in zip(self._procs, self._tasks):
            if proc.is_alive() and not force:
                q.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 60)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for q in [*self._tasks, self._results]:
            # a task no rank will read any more (its rank died) would keep the queue's feeder thread, which
            # the interpreter joins at exit, blocked on a full pipe: exit would hang
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self._stack_dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
