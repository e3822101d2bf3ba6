"""Shared fixtures: a group of 2 real DeepSpeed ranks (gloo, CPU), started once per test module."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(__file__))  # rank tasks import tests' helper modules by name

from async_ckpt.launch import RankGroup  # noqa: E402


class Ranks:
    """A 2-rank group that restarts itself if a previous test tore it down (e.g. after a hang)."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._group: RankGroup | None = None

    def run(self, fn, *args, **kwargs):
        if self._group is None or not self._group.alive:
            self._group = RankGroup(self.world_size)
        return self._group.run(fn, *args, **kwargs)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()


@pytest.fixture(scope="module")
def ranks():
    group = Ranks(2)
    yield group
    group.close()
