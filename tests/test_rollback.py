"""After a rollback (training resumed from an older tag and saving again into the same root), resume,
fallback and retention follow the live run: the newer saves are the ones saved later, not the higher
steps the run abandoned."""

from __future__ import annotations

import pytest

from async_ckpt.catalog import read_manifest
from async_ckpt.commit import apply_retention
from async_ckpt.layout import LATEST
from async_ckpt.resume import older_committed, resolve
from async_ckpt.storage import open_storage
from async_ckpt.tiers import choose_tag, committed_view
from manifests import commit_by_hand

#: (tag, step) in the order saved: steps 1000-3000, then a rollback to 1000 and three more saves
ROLLED_BACK = [("s1000", 1000), ("s2000", 2000), ("s3000", 3000), ("s1100", 1100), ("s1200", 1200), ("s1300", 1300)]


@pytest.fixture
def rolled_back(tmp_path):
    """The root after the rollback; ``latest`` names the last save, s1300."""
    storage = open_storage(str(tmp_path))
    for saved_at, (tag, step) in enumerate(ROLLED_BACK, start=1):
        commit_by_hand(storage, tag, step, saved_at=float(saved_at))
    storage.write_bytes(LATEST, b"s1300")
    return storage


def test_load_resumes_what_latest_names_not_the_abandoned_higher_step(rolled_back):
    assert resolve(rolled_back, None).tag == "s1300"


def test_a_save_that_committed_but_missed_latest_is_resumed_even_below_the_abandoned_steps(rolled_back):
    rolled_back.write_bytes(LATEST, b"s1200")  # the job stopped between s1300's manifest and its latest
    assert resolve(rolled_back, None).tag == "s1300"


def test_without_latest_the_last_save_is_resumed(rolled_back):
    rolled_back.delete(LATEST)
    assert resolve(rolled_back, None).tag == "s1300"


def test_fallback_goes_to_the_live_runs_previous_save_never_to_an_abandoned_step(rolled_back):
    assert older_committed(rolled_back, read_manifest(rolled_back, "s1300")).tag == "s1200"
    assert older_committed(rolled_back, read_manifest(rolled_back, "s1100")).tag == "s1000"


def test_with_tiers_a_restart_and_its_fallback_follow_the_live_run(rolled_back):
    view = committed_view(rolled_back)
    assert choose_tag(None, [view], view) == ("s1300", "")
    assert choose_tag(None, [view], view, older_than="s1100") == ("s1000", "")


def test_keep_last_keeps_the_most_recent_saves_and_drops_the_abandoned_steps_first(rolled_back):
    deleted = apply_retention(rolled_back, "s1300", keep_last=3)
    assert deleted == ["s1000", "s2000", "s3000"]
    assert [t for t, _ in ROLLED_BACK if read_manifest(rolled_back, t)] == ["s1100", "s1200", "s1300"]


def test_keep_every_still_protects_its_steps_after_a_rollback(rolled_back):
    apply_retention(rolled_back, "s1300", keep_last=3, keep_every=1000)
    assert [t for t, _ in ROLLED_BACK if read_manifest(rolled_back, t)] == [
        "s1000", "s2000", "s3000", "s1100", "s1200", "s1300"]
