"""The rank launcher: ranks forked by the preloading server start as spawned ones do, with the group's environment."""

from __future__ import annotations

import os

import pytest
import rank_tasks
from conftest import PRELOAD

from async_ckpt.launch import RankGroup


def test_a_preloaded_rank_gets_the_environment_of_the_moment_it_starts_not_the_servers(monkeypatch):
    # If the suite's fork server is not running yet, it starts here with ASYNC_CKPT_TEST_GONE set;
    # if it is, it holds the PYTEST_CURRENT_TEST of an earlier test. Either way the ranks must not see the server's.
    monkeypatch.setenv("ASYNC_CKPT_TEST_GONE", "set while the fork server starts")
    RankGroup(1, preload=PRELOAD).close()
    monkeypatch.delenv("ASYNC_CKPT_TEST_GONE")
    monkeypatch.setenv("ASYNC_CKPT_TEST_NEW", "set after the server started")
    names = ["ASYNC_CKPT_TEST_GONE", "ASYNC_CKPT_TEST_NEW", "ASYNC_CKPT_TEST_GROUP", "PYTEST_CURRENT_TEST", "RANK"]
    with RankGroup(2, preload=PRELOAD, env={"ASYNC_CKPT_TEST_GROUP": "this group's"}) as group:
        seen = group.run(rank_tasks.environment, names)
    now = os.environ["PYTEST_CURRENT_TEST"]
    assert seen == [[None, "set after the server started", "this group's", now, str(rank)] for rank in range(2)]


def test_a_group_for_another_accelerator_than_the_preloading_servers_is_refused_naming_the_fix():
    RankGroup(1, preload=PRELOAD).close()  # the suite's server: DeepSpeed imported for the CPU accelerator
    with pytest.raises(ValueError, match=r"already imported .* for 'cpu'.*preload=\(\) for spawned ranks"):
        RankGroup(1, env={"DS_ACCELERATOR": "cuda"}, preload=PRELOAD)
