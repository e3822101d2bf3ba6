"""The write-steal probe writes the same bytes every way it compares and counts the machine's CPU for each."""

from __future__ import annotations

import pytest

from async_ckpt.bench.write_steal import MIB, direct_write, main, modes, probe


def test_every_way_of_writing_writes_its_bytes_and_removes_its_file(tmp_path):
    path = str(tmp_path / "probe.bin")
    written = []
    for name, run in modes(path, 64 * MIB).items():
        run()
        written.append(name)
        assert list(tmp_path.iterdir()) == [], name
    assert len(written) == 6


def test_a_direct_write_that_fails_raises_and_leaves_no_file(tmp_path):
    with pytest.raises(OSError):
        direct_write(str(tmp_path / "probe.bin"), 64 * MIB, 1000, 1)  # not a multiple of any block size
    assert list(tmp_path.iterdir()) == []


def test_the_probe_alternates_the_modes_each_round_and_reports_steal_per_gib_for_each_write(tmp_path):
    result = probe(str(tmp_path), 64 * MIB, rounds=1, busy=1)
    assert [row["mode"] for row in result["rows"]] == list(modes("x", 64 * MIB))
    assert all({"wall_s", "user", "system", "steal", "idle"} <= set(row) for row in result["rows"])
    assert set(result["summary"]) == {name for name in modes("x", 64 * MIB) if not name.startswith("idle")}
    assert list(tmp_path.iterdir()) == []


def test_the_probe_refuses_a_size_below_one_request(tmp_path):
    with pytest.raises(SystemExit, match="--gib"):
        main(["--dir", str(tmp_path), "--gib", "0.01"])
