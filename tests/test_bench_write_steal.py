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


def test_a_direct_write_that_fails_raises(tmp_path):
    with pytest.raises(OSError):
        direct_write(str(tmp_path / "probe.bin"), 64 * MIB, 1000, 1)  # not a multiple of any block size


def test_the_probe_measures_each_mode_in_turn_and_each_writes_deletion_apart(tmp_path):
    result = probe(str(tmp_path), 64 * MIB, rounds=1, busy=1)
    writes = [name for name in modes("x", 64 * MIB) if name != IDLE]
    assert [row["mode"] for row in result["rows"]] == [IDLE] + [m for w in writes for m in (w, f"{w}: {DELETE}")]
    assert all({"wall_s", "user", "system", "steal", "idle"} <= set(row) for row in result["rows"])
    assert set(result["summary"]) == {*writes, DELETE}
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
