"""Shared fixtures: a group of 2 real DeepSpeed ranks (gloo, CPU), started once per test module.

Each test run gets a temporary folder of its own, set as ``TMPDIR`` before anything starts, so the
checkpointer's scratch and shadow folders, the caches and every rank's temporary files of this run
are apart from those of any other job on the machine (tests that look for leaks count only this
run's), and DeepSpeed's JIT-built CPU op is built into that folder too (``TORCH_EXTENSIONS_DIR``):
a shared build folder lets another environment's half-built op be loaded. Removed at the end.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest

from async_ckpt.storage.local import memory_filesystem


def _temporary_root() -> str:
    """The system's temporary folder, else /var/tmp, else the repository's folder: the first one not in memory
    (tmpfs). There wrap() makes saves of CPU training synchronous by default, and the tests of background
    saves need a disk."""
    candidates = [tempfile.gettempdir(), "/var/tmp", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    return next((path for path in candidates if os.path.isdir(path) and not memory_filesystem(path)), candidates[0])


RUN_DIR = tempfile.mkdtemp(prefix="async_ckpt_tests_", dir=_temporary_root())
# Registered before multiprocessing is imported, so this runs after multiprocessing's own exit hook
# (atexit runs last-in first-out), which removes the folders it made in RUN_DIR itself.
atexit.register(shutil.rmtree, RUN_DIR, ignore_errors=True)
os.environ["TMPDIR"] = RUN_DIR
os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(RUN_DIR, "torch_extensions")
tempfile.tempdir = None  # recomputed from TMPDIR on next use
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(__file__))  # rank tasks import tests' helper modules by name

import logging  # noqa: E402

from async_ckpt.launch import RankGroup  # noqa: E402
from s3_server import DUMMY_ENV, S3Server  # noqa: E402

if not os.environ.get("ASYNC_CKPT_TEST_S3_ENDPOINT"):
    for key, value in DUMMY_ENV.items():  # ranks inherit these: credentials from the standard AWS environment
        os.environ.setdefault(key, value)
logging.getLogger("werkzeug").setLevel(logging.ERROR)


#: Imported once by the fork server that starts every rank of the suite (``RankGroup(preload=...)``):
#: a spawned rank spends ~5 s of CPU importing these, and the suite starts dozens of groups.
PRELOAD = ("deepspeed", "transformers", "s3fs", "async_ckpt.workload")


class Ranks:
    """A 2-rank group that restarts itself if a previous test tore it down (e.g. after a hang)."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._group: RankGroup | None = None

    def run(self, fn, *args, **kwargs):
        if self._group is None or not self._group.alive:
            self._group = RankGroup(self.world_size, preload=PRELOAD)
        return self._group.run(fn, *args, **kwargs)

    def restart(self) -> None:
        """A brand-new process group (fresh processes, nothing in memory from earlier runs)."""
        self.close()
        self._group = None

    def close(self) -> None:
        if self._group is not None:
            self._group.close()


def rank_group(world_size: int):
    """A group of ``world_size`` ranks, closed when the fixture that yields from this ends."""
    group = Ranks(world_size)
    yield group
    group.close()


@pytest.fixture(scope="module")
def ranks():
    yield from rank_group(2)


@pytest.fixture(scope="session")
def s3():
    """A real S3 HTTP API on 127.0.0.1 (moto server), started once and stopped at the end."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def bucket(s3, request):
    """A fresh, empty bucket for one test (the server is reset first)."""
    s3.reset()
    name = "ckpt-" + request.node.name.lower().replace("_", "-")[:40].strip("-[]")
    return s3.make_bucket("".join(c if c.isalnum() or c == "-" else "-" for c in name))
