"""The write-steal probe writes the same bytes every way it compares and counts the machine's CPU for each."""

from __future__ import annotations

import pytest

from async_ckpt.bench.write_steal import DELETE, IDLE, MIB, delete, direct_write, main, modes, probe


def test_every_way_of_writing_writes_all_its_bytes(tmp_path):
    path = str(tmp_path / "probe.bin")
    for name, run in modes(path, 64 * MIB).items():
        run()
        assert sum(f.stat().st_size for f in tmp_path.iterdir()) == (0 if name == IDLE else 64 * MIB), name
        delete(str(tmp_path))
        assert list(tmp_path.iterdir()) == [], name


def test_a_paced_direct_write_takes_at_least_its_bytes_over_its_rate(tmp_path):
    import time

    started = time.monotonic()
    direct_write(str(tmp_path / "probe.bin"), 16 * MIB, 4 * MIB, 2, rate=32 * MIB)  # a lower bound set by sleeps
    assert time.monotonic() - started >= 0.5
    assert (tmp_path / "probe.bin").stat().st_size == 16 * MIB


def test_a_direct_write_that_fails_raises(tmp_path):
    with pytest.raises(OSError):
        direct_write(str(tmp_path / "probe.bin"), 64 * MIB, 1000, 1)  # not a multiple of any block size


def test_the_probe_measures_each_mode_in_turn_and_each_writes_deletion_apart(tmp_path):
    result = probe(str(tmp_path), 64 * MIB, rounds=1, busy=1)
    writes = [name for name in modes("x", 64 * MIB) if name != IDLE]
    assert [row["mode"] for row in result["rows"]] == [IDLE] + [m for w in writes for m in (w, f"{w}: {DELETE}")]
    assert all({"wall_s", "user", "system", "steal", "idle"} <= set(row) for row in result["rows"])
    assert set(result["summary"]) == {*writes, DELETE}
    later = next(name for name in writes if "fsync 5 s later" in name)
    assert set(result["summary"][later]["phase_steal_s_per_gib"]) == {"write", "wait", "fsync"}
    assert result["summary"][later]["phase_wall_s_median"]["wait"] >= 5.0
    assert list(tmp_path.iterdir()) == []


def test_the_probe_refuses_a_size_below_one_request(tmp_path):
    with pytest.raises(SystemExit, match="--gib"):
        main(["--dir", str(tmp_path), "--gib", "0.01"])


def test_steal_per_gib_is_counted_beyond_the_quietest_idle_rounds_rate():
    from async_ckpt.bench.write_steal import GIB, summarize

    rows = [{"mode": IDLE, "wall_s": 5.0, "steal": 0.05}, {"mode": IDLE, "wall_s": 5.0, "steal": 0.5},  # after trims
            {"mode": "w", "wall_s": 2.0, "steal": 0.82}, {"mode": f"w: {DELETE}", "wall_s": 1.0, "steal": 0.21}]
    result = summarize(rows, 2 * GIB)
    assert result["idle_steal_per_s"] == pytest.approx(0.01)
    assert result["summary"]["w"]["steal_s_per_gib"] == pytest.approx(0.41)
    assert result["summary"]["w"]["extra_steal_s_per_gib"] == pytest.approx(0.40)
    assert result["summary"][DELETE]["extra_steal_s_per_gib"] == pytest.approx(0.10)
    assert "phase_steal_s_per_gib" not in result["summary"]["w"]


def test_a_modes_phases_are_summarized_per_gib_as_measured():
    from async_ckpt.bench.write_steal import GIB, summarize

    rows = [{"mode": IDLE, "wall_s": 5.0, "steal": 0.0},
            {"mode": "w", "wall_s": 7.0, "steal": 0.6, "write_wall_s": 1.0, "write_steal": 0.4,
             "fsync_wall_s": 1.0, "fsync_steal": 0.2},
            {"mode": "w", "wall_s": 7.0, "steal": 0.8, "write_wall_s": 3.0, "write_steal": 0.6,
             "fsync_wall_s": 1.0, "fsync_steal": 0.2}]
    summary = summarize(rows, 2 * GIB)["summary"]["w"]
    assert summary["phase_steal_s_per_gib"] == pytest.approx({"write": 0.25, "fsync": 0.1})
    assert summary["phase_wall_s_median"] == pytest.approx({"write": 2.0, "fsync": 1.0})
