"""The rank launcher: ranks forked by the preloading server start as spawned ones do, with the group's environment;
ranks whose starter dies without closing them end on their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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


_STARTER = """
import sys
from async_ckpt.launch import RankGroup
group = RankGroup(1, preload=tuple(sys.argv[1:]))
print("rank pid", group._procs[0].pid, flush=True)
sys.stdin.read()
"""


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: whoever adopted it may not reap it at once)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("preload", [(), PRELOAD], ids=["spawned", "preloaded"])
def test_a_rank_whose_starter_is_killed_exits_on_its_own(preload, tmp_path):
    stderr = open(tmp_path / "stderr", "w")  # noqa: SIM115 (the rank inherits it, and writes to it after its starter)
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, *preload], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = ""
        while not line.startswith("rank pid"):  # the rank shares the pipe, and prints what DeepSpeed says
            line = starter.stdout.readline()
            assert line, "the starter ended before its rank started"
        rank_pid = int(line.split()[-1])
        assert not _gone(rank_pid)
        starter.send_signal(signal.SIGTERM)  # Python runs no finally on SIGTERM: the group is never closed
        starter.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _gone(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(rank_pid), f"rank {rank_pid} outlived the process that started it"
        assert "the process that started its group" in (tmp_path / "stderr").read_text()
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        starter.stdout.close()
        starter.stdin.close()
        stderr.close()


_DEAD_RANK = """
import os, signal
from async_ckpt.launch import RankError, RankGroup
group = RankGroup(1)
os.kill(group._procs[0].pid, signal.SIGKILL)
group._procs[0].join()
try:
    group.run(len, b"x" * (4 << 20), timeout_s=30)  # more than a pipe holds: it stays in the queue's thread
except RankError as exc:
    print("refused:", str(exc).splitlines()[0], flush=True)
"""


def test_a_task_left_for_a_dead_rank_does_not_hold_up_the_owners_exit():
    done = subprocess.run([sys.executable, "-c", _DEAD_RANK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "refused: len: rank(s) [0] died" in done.stdout, done.stderr[-2000:]

