"""The save benchmark runs end to end in --quick mode (behaviour only: no timing is asserted)."""

from __future__ import annotations

import json
import os

import pytest
import rank_tasks
import torch.distributed as dist

from async_ckpt.bench.floors import CHUNK, WAYS, _write_s, typical_and_best
from async_ckpt.bench.methods import METHODS, ON_REQUEST
from async_ckpt.bench.report import table as report_table
from async_ckpt.bench.save_bench import DEFAULT_METHODS, BenchConfig, run
from async_ckpt.errors import UsageError
from async_ckpt.launch import RankError

METRICS = {"stall_s", "durable_s", "persist_gbps", "persist_vs_floor", "stall_vs_copy_floor", "bytes_per_save",
           "lost_incl_writeback_per_save_s", "writeback_window_s", "written_back",
           "slowdown_while_persisting", "next_step_over_before_s"}


#: On S3, the methods every test below names (the others write through the same storage); every
#: default method runs on local disk.
S3_METHODS = ["stock", "async_ckpt", "async_ckpt_copy_in_save", "dcp_async"]


@pytest.fixture(scope="module", params=["local", "s3"])
def bench(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"bench-{request.param}")
    methods = {"methods": S3_METHODS} if request.param == "s3" else {}
    report = run(BenchConfig.quick(target=request.param, out=str(out), workdir=str(out / "work"), floor_samples=2,
                                   **methods))
    return out, report


def test_bench_writes_json_with_every_method_it_was_asked_for(bench):
    out, report = bench
    data = json.loads((out / "results.json").read_text())
    asked = S3_METHODS if report["target"]["kind"] == "s3" else DEFAULT_METHODS
    assert set(data["summary"]["methods"]) == set(asked) and set(DEFAULT_METHODS) == set(METHODS) - set(ON_REQUEST)
    assert "async_ckpt_process" not in DEFAULT_METHODS  # a prototype: run when named only
    assert data["machine"]["cpus"] >= 1 and data["config"]["workload"] == "gpt"


def test_bench_reports_every_metric_for_each_method_that_ran(bench):
    _, report = bench
    ran = {n: m for n, m in report["summary"]["methods"].items() if "skipped" not in m}
    assert {"stock", "async_ckpt", "async_ckpt_copy_in_save", "dcp_async"} <= set(ran)
    for name, metrics in ran.items():
        assert METRICS <= set(metrics), name
        assert metrics["stall_s"] > 0 and metrics["bytes_per_save"] > 0


def test_bench_records_each_steps_cpu_and_page_faults_and_what_a_background_write_adds_to_them(bench):
    _, report = bench
    for rank in report["ranks"]:
        assert all(step["cpu_s"] >= 0 and step["page_faults"] >= 0 for step in rank["steps"])
        assert sum(step["cpu_s"] for step in rank["steps"]) > 0
    for name in ("async_ckpt", "async_ckpt_copy_in_save"):
        m = report["summary"]["methods"][name]
        for key in ("extra_cpu_per_step_while_persisting_s", "extra_page_faults_per_step_while_persisting"):
            assert (m[key] is None) == (m["steps_inside_windows"] == 0), (name, key)


def test_bench_attributes_each_steps_cpu_to_the_threads_that_used_it(bench):
    _, report = bench
    for rank in report["ranks"]:
        for step in rank["steps"]:
            assert all(cpu > 0 for cpu in step["threads_cpu_s"].values())
        assert any("MainThread" in step["threads_cpu_s"] for step in rank["steps"])  # the training thread
    m = report["summary"]["methods"]["async_ckpt"]
    assert (m["extra_cpu_per_step_by_thread_s"] is None) == (m["steps_inside_windows"] == 0)


def test_extra_cpu_by_thread_counts_a_thread_missing_from_a_step_as_no_cpu():
    from async_ckpt.bench.report import _extra_by_thread

    inside = [{"threads_cpu_s": {"MainThread": 1.0, "async_ckpt-crc": 0.4}},
              {"threads_cpu_s": {"MainThread": 1.2, "async_ckpt-crc": 0.2}},
              {"threads_cpu_s": {"MainThread": 1.1}}]
    outside = [{"threads_cpu_s": {"MainThread": 1.0}}, {"threads_cpu_s": {"MainThread": 0.8, "native": 0.1}}]
    assert _extra_by_thread(inside, outside) == pytest.approx({"MainThread": 0.2, "async_ckpt-crc": 0.2,
                                                               "native": -0.05})
    assert _extra_by_thread(inside, [{"method": "stock"}]) is None


def test_cpu_of_threads_that_ended_during_a_step_is_the_process_total_minus_the_threads_listed():
    from async_ckpt.bench.thread_cpu import ENDED, with_ended

    assert with_ended({"MainThread": 1.0, "native": 0.2}, 1.5) == pytest.approx(
        {"MainThread": 1.0, "native": 0.2, ENDED: 0.3})
    assert with_ended({"MainThread": 1.0, "native": 0.2}, 1.21) == {"MainThread": 1.0, "native": 0.2}  # rounding


def test_a_threads_cpu_is_counted_under_its_python_name_without_the_pool_number():
    import threading
    import time

    from async_ckpt.bench.thread_cpu import cpu_delta, thread_cpu

    spun, done = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait()

    worker = threading.Thread(target=spin, name="probe_3")
    before = thread_cpu()
    worker.start()
    try:
        assert spun.wait(10)
        used = cpu_delta(before, thread_cpu())
    finally:
        done.set()
        worker.join()
    assert used["probe"] >= 0.05 and "probe_3" not in used


def test_the_step_after_a_save_is_measured_against_the_steps_just_before_it_not_the_runs_median():
    from async_ckpt.bench.report import next_step_over_before

    def steps(method, start, durations):
        out = []
        for d in durations:
            out.append({"method": method, "start": start, "end": start + d})
            start += d
        return out, start

    # the run drifts from 1 s steps to 2 s steps; each save's next step is 0.5 s over its neighbours
    other, t = steps("stock", 0.0, [1.0] * 20)
    before1, t = steps("async_ckpt", t, [1.0, 1.0, 1.0])
    save1 = {"start": t, "call_s": 0.1}
    after1, t = steps("async_ckpt", t + 0.1, [1.5, 1.0, 2.0, 2.0])
    save2 = {"start": t, "call_s": 0.1}
    after2, _ = steps("async_ckpt", t + 0.1, [2.5, 2.0])
    extra = next_step_over_before(other + before1 + after1 + after2, "async_ckpt", [save1, save2], before=3)
    assert extra == pytest.approx(0.5)


def test_the_steps_before_a_save_leave_out_those_an_earlier_save_was_writing_through():
    from async_ckpt.bench.report import next_step_over_before

    durations = [1.0, 1.0, 3.0, 3.0, 1.0, 2.0]  # a save at 2.0 s is durable at 8.0 s; another at 9.0 s
    starts = [0.0, 1.0, 2.0, 5.0, 8.0, 9.0]
    steps = [{"method": "m", "start": t, "end": t + d} for t, d in zip(starts, durations)]
    saves = [{"start": 2.0, "call_s": 0.0, "durable_s": 6.0}, {"start": 9.0, "call_s": 0.0, "durable_s": 1.0}]
    # first save: 3 s against 1 s; second: 2 s against the clean steps before it (1, 1 and 1 s), not 3 s ones
    assert next_step_over_before(steps, "m", saves, before=3) == pytest.approx(1.5)


def test_dcp_time_to_durable_runs_from_the_save_call_including_its_wait_for_the_previous_save(tmp_path):
    import threading
    import time
    from concurrent.futures import Future
    from types import SimpleNamespace

    from async_ckpt.bench.methods import DcpAsyncSave

    futures = []

    def async_save(state, storage_writer, process_group):  # the first save ends 0.5 s on, the second at once
        future = Future()
        if futures:
            future.set_result(None)
        else:
            threading.Timer(0.5, future.set_result, (None,)).start()
        futures.append(future)
        return future

    method = DcpAsyncSave.__new__(DcpAsyncSave)
    method.__dict__.update(rank=0, target={"kind": "local"}, root=str(tmp_path), futures=[], durable_s=[],
                           extra_stall_s=[], group=None, bytes_per_save=1,
                           dcp=SimpleNamespace(FileSystemWriter=lambda *a, **k: None, async_save=async_save),
                           engine=SimpleNamespace(optimizer=SimpleNamespace(state_dict=dict)))
    method.save("first")
    started = time.perf_counter()
    method.save("second")  # waits for the first
    call_s = time.perf_counter() - started
    method.finish()
    assert len(method.durable_s) == 2 and method.durable_s[1] > call_s / 2  # not ~0: the call waited 0.5 s


def test_bench_runs_every_method_it_was_asked_for(bench):
    """A method whose setup fails is reported skipped, with its error: here every one must run."""
    _, report = bench
    assert {name: m["skipped"] for name, m in report["summary"]["methods"].items() if "skipped" in m} == {}


def test_bench_reports_floors_and_flat_staging(bench):
    _, report = bench
    summary = report["summary"]
    assert summary["floor"]["copy_s"] > 0 and summary["floor"]["local_write_gbps"] > 0
    assert summary["methods"]["async_ckpt"]["staging_flat"] is True
    if report["target"]["kind"] == "s3":
        assert summary["floor"]["s3_upload_gbps"] > 0


def test_bench_tells_async_ckpts_time_to_durable_apart_beside_the_floors_time_for_the_same_bytes(bench):
    out, report = bench
    methods = report["summary"]["methods"]
    profile = methods["async_ckpt"]["durable_profile"]
    assert profile["longest_file_s"] > 0 and profile["mark_s"] > 0 and profile["stall_s"] > 0
    assert methods["stock"]["durable_profile"] is None  # no async_ckpt metrics to tell apart
    assert profile["floor_s"] > 0  # the S3 upload's floor on S3, the disk's on local disk
    assert (profile["floor_while_training_s"] is None) == (report["target"]["kind"] == "s3")
    rows = [line for line in (out / "table.md").read_text().splitlines() if line.startswith("| async_ckpt |")]
    assert len(rows) >= 2  # the main table's row and the profile's


def test_bench_on_local_disk_also_measures_the_write_floor_while_training(bench):
    _, report = bench
    floor, ours = report["summary"]["floor"], report["summary"]["methods"]["async_ckpt"]
    if report["target"]["kind"] == "s3":  # S3's floor is the upload's: no local write to compare with
        assert floor["local_write_while_training_gbps"] is None and ours["persist_vs_floor_while_training"] is None
        return
    assert all(r["floor"]["local_write_while_training_s"] > 0 for r in report["ranks"])
    assert floor["local_write_while_training_gbps"] > 0
    assert ours["persist_vs_floor_while_training"] == pytest.approx(
        ours["persist_gbps"] / floor["local_write_while_training_gbps"])


def test_bench_on_local_disk_also_gives_persist_against_the_floors_best_sample(bench):
    _, report = bench
    floor, ours = report["summary"]["floor"], report["summary"]["methods"]["async_ckpt"]
    if report["target"]["kind"] == "s3":
        assert floor["local_write_best_sample_gbps"] is None and ours["persist_vs_best_floor_sample"] is None
        return
    assert floor["local_write_best_sample_gbps"] >= floor["local_write_gbps"]
    assert ours["persist_vs_best_floor_sample"] == pytest.approx(
        ours["persist_gbps"] / floor["local_write_best_sample_gbps"])


def test_the_floor_while_training_trains_as_many_steps_on_every_rank_while_the_write_runs(ranks, tmp_path):
    first, second = ranks.run(rank_tasks.floor_write_while_training, str(tmp_path))
    assert first["steps"] and len(first["steps"]) == len(second["steps"])  # collective steps, as many on each
    assert first["steps"][0] and second["steps"][0]  # the write ran beside the first step
    assert 0 < first["seconds"] < float("inf") and 0 < second["seconds"] < float("inf")
    assert os.listdir(tmp_path) == []


def test_a_floor_write_failing_on_one_rank_raises_there_without_leaving_the_other_waiting(ranks, tmp_path):
    with pytest.raises(RankError, match="File too large") as failed:
        ranks.run(rank_tasks.floor_write_while_training, str(tmp_path), file_size_limit_on_rank=1, timeout_s=120)
    assert failed.value.partial[0]["steps"]  # rank 0 finished its own write and returned
    assert os.listdir(tmp_path) == []  # rank 1's part-written file removed too
    assert ranks.run(dist.get_world_size) == [2, 2]  # and the group still answers


def test_bench_gives_no_ratio_to_the_durable_floor_for_a_method_that_does_not_fsync(bench):
    _, report = bench
    methods = report["summary"]["methods"]
    assert methods["stock"]["fsynced"] is False and methods["stock"]["persist_vs_floor"] is None
    assert methods["async_ckpt"]["fsynced"] is True and methods["async_ckpt"]["persist_vs_floor"] > 0
    assert "(not fsynced)" in report_table(report).split("| stock |")[1].split("\n")[0]


def test_bench_measures_each_methods_peak_memory_in_its_turn_and_its_set_up_time(bench):
    _, report = bench
    methods = {n: m for n, m in report["summary"]["methods"].items() if "skipped" not in m}
    for name, m in methods.items():
        assert m["peak_rss_above_start_bytes"] >= 0 and m["setup_s"] >= 0, name
        assert m["peak_gpu_above_start_bytes"] is None, name  # CPU ranks: no device memory
    assert methods["stock"]["peak_rss_vs_stock"] == 1.0
    assert "peak RSS above start" in report_table(report)
    for rank in report["ranks"]:  # async_ckpt's set-up runs on until its staging reserve is ready
        for start, end in rank["methods"]["async_ckpt"]["setup_windows"]:
            assert end >= start + rank["methods"]["async_ckpt"]["setup_s"] - 1e-6


def test_the_write_floor_is_the_median_of_the_best_way_as_a_saves_time_to_durable_is_a_median():
    samples = {"buffered": [1.0, 0.9, 1.1], "direct": [0.30, 0.20, 0.28], "direct x2": [0.25, 0.27, 0.26]}
    assert typical_and_best(samples) == (0.26, 0.20)  # the lucky 0.20 is the best draw, not the floor


def test_the_ranks_floor_takes_each_sample_at_its_slowest_rank_as_they_write_at_once():
    from async_ckpt.bench.report import GB, _floor_gbps

    def rank(direct):
        return {"floor": {"bytes": GB, "local_write_s": 0.0, "local_write_best_s": 0.0,
                          "local_write_samples": {"direct": direct}}}

    ranks = [rank([1.0, 3.0, 2.0]), rank([3.0, 1.0, 2.0])]  # each rank's own median is 2 s
    assert _floor_gbps(ranks, "local_write_s") == pytest.approx(2 / 3.0)  # the samples took 3, 3 and 2 s
    assert _floor_gbps(ranks, "local_write_best_s") == pytest.approx(2 / 2.0)


def test_bench_times_each_way_of_the_floor_as_many_times_as_asked(bench):
    _, report = bench
    for rank in report["ranks"]:
        samples = rank["floor"]["local_write_samples"]
        assert set(samples) == set(WAYS) and all(len(times) == report["config"]["floor_samples"]
                                                 for times in samples.values())
        assert (rank["floor"]["local_write_s"], rank["floor"]["local_write_best_s"]) == typical_and_best(samples)


@pytest.mark.parametrize("direct,streams", WAYS.values(), ids=list(WAYS))
def test_the_write_floor_writes_every_byte_in_each_of_its_ways(tmp_path, direct, streams):
    from async_ckpt.storage.base import anonymous_memory

    block = anonymous_memory(CHUNK)
    block.write(os.urandom(CHUNK))
    path = str(tmp_path / "floor.bin")
    nbytes = 2 * CHUNK + 5000  # a partial last chunk, rounded up to whole pages
    seconds = _write_s(path, nbytes, block, direct, streams)
    if direct and seconds == float("inf"):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    assert seconds > 0
    data = open(path, "rb").read()
    assert len(data) == 2 * CHUNK + 8192
    assert data[:CHUNK] == data[CHUNK:2 * CHUNK] == bytes(block) and data[2 * CHUNK:] == bytes(block)[:8192]


def test_bench_writes_the_timeline_png(bench):
    out, _ = bench
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_s3_transfer_compares_both_clients_in_both_directions_at_each_concurrency(tmp_path):
    from async_ckpt.bench.s3_transfer import CONCURRENCY, main as transfer_main

    out = tmp_path / "transfer.json"
    assert transfer_main(["--mib", "8", "--part-mib", "5", "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["median_gbps"]) == {f"{who}_{d}_x{c}" for who in ("async_ckpt", "boto3")
                                        for d in ("upload", "download") for c in CONCURRENCY}
    assert data["upload_ratio_vs_boto3"] > 0 and data["download_ratio_vs_boto3"] > 0
    assert data["uploader_peak_buffered_bytes"] > 0


def test_s3_transfer_against_the_null_server_measures_uploads_only(tmp_path):
    from async_ckpt.bench.s3_transfer import main as transfer_main

    out = tmp_path / "null.json"
    assert transfer_main(["--server", "null", "--mib", "8", "--part-mib", "5", "--repeats", "1",
                          "--concurrency", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["median_gbps"]) == {"async_ckpt_upload_x4", "boto3_upload_x4"}
    assert data["upload_ratio_vs_boto3"] > 0 and "download_ratio_vs_boto3" not in data


def test_s3_transfer_runs_over_https_against_moto_tls(tmp_path):
    from async_ckpt.bench.s3_transfer import main as transfer_main

    out = tmp_path / "tls.json"
    assert transfer_main(["--server", "moto-tls", "--mib", "8", "--part-mib", "5", "--repeats", "1",
                          "--concurrency", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["server"] == "moto-tls" and data["upload_ratio_vs_boto3"] > 0 and data["download_ratio_vs_boto3"] > 0


def test_tiered_bench_reports_saves_to_both_tiers_and_three_comparable_restarts(tmp_path):
    from async_ckpt.bench.save_bench import main as bench_main

    out = tmp_path / "tiered"
    assert bench_main(["--target", "tiered", "--quick", "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    data = json.loads((out / "results.json").read_text())
    summary = data["summary"]
    assert len(summary["saves"]) == data["config"]["saves"] == 2
    for save in summary["saves"]:
        assert save["tiers"] == ["local"]
        assert 0 < save["local_committed_s"] < save["durable_s"]
    assert summary["local_committed_s"] > 0 and summary["durable_s"] > 0
    restarts = summary["restarts"]
    assert set(restarts) == {"local", "bucket", "stock"}
    for how, restart in restarts.items():
        assert restart["restart_s"] > restart["load_s"] > 0, how
        assert (restart["tag"], restart["global_steps"]) == (summary["resumed"]["tag"],
                                                             summary["resumed"]["global_steps"])
        assert restart["first_loss_as_saved"] is True, how
        assert restart["bytes_read"] > 0
    assert restarts["local"]["bytes_downloaded"] == 0
    assert restarts["bucket"]["bytes_downloaded"] > 0 and restarts["stock"]["bytes_downloaded"] > 0
    for how, tier in (("local", "local"), ("bucket", "durable")):  # one line per rank: which tier it read
        assert len(restarts[how]["tiers"]) == 2
        assert all(f"from the {tier} tier" in line for line in restarts[how]["tiers"]), how
    assert summary["bucket_over_local"] > 0 and summary["stock_over_local"] > 0
    assert "Tiered checkpoints" in (out / "table.md").read_text()


def _quick_bench(tmp_path, *args):
    """A --quick bench run through the command line; returns results.json."""
    from async_ckpt.bench.save_bench import main as bench_main

    out = tmp_path / "out"
    assert bench_main(["--quick", "--out", str(out), "--workdir", str(tmp_path / "work"), *args]) == 0
    return json.loads((out / "results.json").read_text())


def _assert_every_save_durable(data, methods):
    assert list(data["summary"]["methods"]) == methods
    for name in methods:
        assert "skipped" not in data["summary"]["methods"][name], name
        for rank in data["ranks"]:
            saves = rank["methods"][name]["saves"]
            assert len(saves) == data["config"]["saves"] * data["config"]["rounds"] and data["config"]["saves"] == 2, name
            assert all(save["durable_s"] is not None and save["durable_s"] > 0 for save in saves), name
        assert data["summary"]["methods"][name]["bytes_per_save"] > 0, name


@pytest.fixture(scope="module")
def mlp_rounds(tmp_path_factory):
    """One --quick run of the MLP workload, stock and async_ckpt taking turns twice."""
    return _quick_bench(tmp_path_factory.mktemp("mlp_rounds"), "--workload", "mlp", "--methods", "stock,async_ckpt",
                        "--rounds", "2")


def test_bench_mlp_workload_trains_the_linear_stack_and_saves_with_each_method(mlp_rounds):
    data = mlp_rounds
    assert data["config"]["workload"] == "mlp" and data["config"]["size"] == "tiny"
    _assert_every_save_durable(data, ["stock", "async_ckpt"])
    from async_ckpt.workload import MLP_SIZES

    n_linear, width, _ = MLP_SIZES["tiny"]
    fp32_adam_state = n_linear * (width * width + width) * 12  # master weights and two moments, over the ranks
    assert data["summary"]["methods"]["async_ckpt"]["bytes_per_save"] > fp32_adam_state


def test_bench_rounds_let_the_methods_take_turns_and_gather_every_rounds_saves(mlp_rounds):
    saves_per_round = mlp_rounds["config"]["saves"]
    for rank in mlp_rounds["ranks"]:
        for name in ("stock", "async_ckpt"):
            saves = rank["methods"][name]["saves"]
            assert [(s["round"], s["index"]) for s in saves] == [(r, i) for r in (0, 1) for i in range(saves_per_round)]
        turns = [(step["round"], step["method"]) for step in rank["steps"] if step["method"] != "warmup"]
        order = [t for i, t in enumerate(turns) if i == 0 or turns[i - 1] != t]
        # ABBA: the second round runs the methods in reverse order
        assert order == [(0, "stock"), (0, "async_ckpt"), (1, "async_ckpt"), (1, "stock")]


def test_bench_rounds_leave_every_rounds_first_save_out_of_the_steady_stall(mlp_rounds):
    import statistics

    ranks = mlp_rounds["ranks"]
    saves = ranks[0]["methods"]["async_ckpt"]["saves"]
    stalls = [max(r["methods"]["async_ckpt"]["saves"][i]["call_s"] + r["methods"]["async_ckpt"]["saves"][i]["extra_stall_s"]
                  for r in ranks) for i in range(len(saves))]
    steady = statistics.median(stall for stall, save in zip(stalls, saves) if save["index"] > 0)
    assert mlp_rounds["summary"]["methods"]["async_ckpt"]["first_vs_steady_stall"] == pytest.approx(stalls[0] / steady)


def test_bench_refuses_rounds_below_one_and_rounds_of_tiered_runs(tmp_path):
    from async_ckpt.bench.save_bench import BenchConfig

    with pytest.raises(UsageError, match="--rounds"):
        run(BenchConfig.quick(rounds=0, out=str(tmp_path)))
    with pytest.raises(UsageError, match="--rounds"):
        run(BenchConfig.quick(target="tiered", rounds=2, out=str(tmp_path)))


def test_bench_writer_process_prototype_writes_the_same_bytes_as_the_writer_thread(tmp_path):
    data = _quick_bench(tmp_path, "--methods", "async_ckpt,async_ckpt_process")
    _assert_every_save_durable(data, ["async_ckpt", "async_ckpt_process"])
    methods = data["summary"]["methods"]
    assert methods["async_ckpt_process"]["bytes_per_save"] == methods["async_ckpt"]["bytes_per_save"]
    for rank in data["ranks"]:
        ours = rank["methods"]["async_ckpt_process"]
        assert ours["bytes_per_save"] == rank["methods"]["async_ckpt"]["bytes_per_save"]
        assert "writer process" in ours["note"] and " 0 files" not in ours["note"]


@pytest.fixture(scope="module")
def pieces_ab(tmp_path_factory):
    """One --quick run of the defaults and three A/Bs (128 MiB pieces; buffered writes; no fsync), at
    micro-batch 3 and 3 threads per rank."""
    return _quick_bench(tmp_path_factory.mktemp("pieces_ab"), "--micro-batch", "3", "--threads-per-rank", "3",
                        "--methods", "async_ckpt,async_ckpt_pieces128,async_ckpt_buffered,async_ckpt_no_fsync")


def test_bench_micro_batch_option_sets_every_ranks_micro_batch(pieces_ab):
    assert pieces_ab["config"]["micro_batch"] == 3
    assert [rank["micro_batch"] for rank in pieces_ab["ranks"]] == [3, 3]


def test_bench_threads_per_rank_option_sets_every_ranks_pytorch_threads(pieces_ab):
    assert pieces_ab["config"]["threads_per_rank"] == 3
    assert [rank["threads"] for rank in pieces_ab["ranks"]] == [3, 3]


def test_bench_ab_methods_finish_every_save(pieces_ab):
    _assert_every_save_durable(pieces_ab, ["async_ckpt", "async_ckpt_pieces128", "async_ckpt_buffered",
                                           "async_ckpt_no_fsync"])


@pytest.mark.parametrize("ab", ["async_ckpt_pieces128", "async_ckpt_buffered", "async_ckpt_no_fsync"])
def test_bench_ab_methods_save_the_same_bytes_as_the_defaults(pieces_ab, ab):
    for rank in pieces_ab["ranks"]:
        ours = rank["methods"]
        assert ours[ab]["bytes_per_save"] == ours["async_ckpt"]["bytes_per_save"]


def test_bench_buffered_ab_writes_without_o_direct_and_the_defaults_with_it(pieces_ab):
    for rank in pieces_ab["ranks"]:
        assert rank["methods"]["async_ckpt"]["settings"]["direct_io"] is True
        assert rank["methods"]["async_ckpt_buffered"]["settings"]["direct_io"] is False


def test_bench_no_fsync_ab_publishes_without_fsync_and_the_defaults_with_it(pieces_ab):
    for rank in pieces_ab["ranks"]:
        assert rank["methods"]["async_ckpt"]["settings"]["fsync"] is True
        assert rank["methods"]["async_ckpt_no_fsync"]["settings"]["fsync"] is False


def test_writer_process_serializes_in_its_worker_and_restores_the_writer(tmp_path):
    import os

    import torch

    import async_ckpt.writer as writer_module
    from async_ckpt.bench.writer_process import WriterProcess
    from async_ckpt.serialization import write_torch_file
    from async_ckpt.storage import open_storage
    from async_ckpt.storage.local import LocalStorage

    storage = LocalStorage(str(tmp_path / "root"))
    flat = torch.arange(64, dtype=torch.float32)
    tagged = torch.zeros(5)
    tagged.ds_id = "0_27"  # ZeRO-3 tags its flat groups; torch.save writes the attribute, so must the worker
    obj = {"a": flat[:32].view(4, 8), "b": [flat[32:], torch.ones(3, dtype=torch.int64)], "step": 7, "g": [tagged]}
    thread_entry = write_torch_file(storage, "t1/thread.pt", obj, tag_dir="t1", rank=0)
    original = writer_module.write_torch_file
    worker = WriterProcess()
    try:
        worker.patch()
        assert writer_module.write_torch_file != original
        entry = writer_module.write_torch_file(storage, "t2/thread.pt", obj, tag_dir="t2", rank=0)
        assert flat.is_shared() and worker.stats["files"] == 1
        assert (entry.path, entry.size, entry.crc32) == (thread_entry.path, thread_entry.size, thread_entry.crc32)
        loaded = torch.load(os.path.join(storage.root, "t2", "thread.pt"))
        assert torch.equal(loaded["a"], obj["a"]) and torch.equal(loaded["b"][0], flat[32:])
        assert loaded["g"][0].ds_id == "0_27"
        (tmp_path / "root" / "blocked").write_text("a file where the tag folder should go")
        with pytest.raises(OSError):  # the worker's error is raised in the caller
            writer_module.write_torch_file(storage, "blocked/x.pt", obj, tag_dir="blocked", rank=0)
        with pytest.raises(RuntimeError, match="local folders only"):
            writer_module.write_torch_file(open_storage("memory://bench/x"), "t3/x.pt", obj, tag_dir="t3", rank=0)
    finally:
        worker.close()
    assert writer_module.write_torch_file is original
    assert worker._proc.exitcode is not None


def test_writer_cost_measures_each_way_of_writing_a_file_and_stocks(tmp_path):
    from async_ckpt.bench.writer_cost import measure

    result = measure(4, 1, str(tmp_path))
    assert set(result) == {"copying", "lending", "in_place", "torch_save"}
    assert all(way["wall_s"] > 0 and way["cpu_s"] >= 0 and way["gbps"] > 0 for way in result.values())


def test_copy_checksum_measures_the_copy_alone_then_checksummed_and_in_cache_at_each_piece_size():
    from async_ckpt.bench.copy_checksum import CACHED_SIZES, measure

    result = measure(4, 1)
    assert set(result) == {"copy", "copy_then_crc", *(f"cached_{size // 1024}k" for size in CACHED_SIZES)}
    assert all(way["wall_s"] > 0 and way["cpu_s"] > 0 for way in result.values())


def _trace(*events: tuple) -> dict:
    """A Chrome trace of (cat, name, tid, start us, duration us) complete events, all in one process."""
    return {"traceEvents": [{"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
                            for cat, name, tid, ts, dur in events]}


def test_step_profile_reduces_a_trace_to_one_row_per_annotated_step_with_gpu_and_thread_figures():
    from async_ckpt.bench.step_profile import SAVE, STEP, reduce_trace

    rows = reduce_trace(_trace(
        ("user_annotation", STEP, 10, 0, 10_000), ("user_annotation", SAVE, 10, 10_000, 1_000),
        ("cpu_op", "aten::mm", 10, 1_000, 4_000), ("cpu_op", "aten::add", 10, 3_000, 4_000),  # overlap: 6 ms in ops
        ("cuda_runtime", "cudaLaunchKernel", 10, 8_000, 500),
        ("cuda_runtime", "cudaHostUnregister", 20, 2_000, 3_000),  # another thread
        ("kernel", "gemm", 0, 1_000, 2_000), ("kernel", "gemm", 0, 6_000, 1_000),  # GPU idle 3..6 ms: the longest gap
        ("gpu_memcpy", "Memcpy DtoH", 0, 10_200, 400)))
    step, save = rows
    assert (step["kind"], step["wall_ms"], step["ops_ms"], step["outside_ops_ms"]) == ("step", 10.0, 6.0, 4.0)
    assert (step["gpu_busy_ms"], step["copy_ms"], step["gap_ms"]) == (3.0, 0.0, 3.0)
    assert step["gap_in"] == [["aten::add", 3.0], ["aten::mm", 2.0]]
    assert step["cuda_api_top"] == [["cudaLaunchKernel", 0.5]]
    assert step["others_cuda_api"] == [["cudaHostUnregister", 3.0]]
    assert (save["kind"], save["copy_ms"], save["gpu_busy_ms"]) == ("save", 0.4, 0.0)


def test_step_profile_refuses_a_trace_without_its_annotations():
    from async_ckpt.bench.step_profile import reduce_trace

    with pytest.raises(ValueError, match="record_function"):
        reduce_trace(_trace(("cpu_op", "aten::mm", 10, 0, 1_000)))


def test_step_profile_profiles_the_steps_around_each_save_on_a_real_rank(tmp_path):
    from async_ckpt.bench.step_profile import main

    assert main(["--size", "tiny", "--micro-batch", "3", "--saves", "1", "--before", "1", "--after", "2",
                 "--steps-between", "0",
                 "--warmup", "1", "--out", str(tmp_path)]) == 0
    windows = json.loads((tmp_path / "profile.json").read_text())["windows"]
    assert [row["kind"] for row in windows[0]["rows"]] == ["step", "save", "step", "step"]
    assert [row["index"] for row in windows[0]["rows"]] == [-1, 0, 1, 2]
    assert all(row["ops_ms"] > 0 for row in windows[0]["rows"] if row["kind"] == "step")
    assert windows[0]["durable_s"] > 0
    assert (tmp_path / "trace_save0.json.gz").stat().st_size > 0
    assert "| 0 | save |" in (tmp_path / "profile.md").read_text()


def test_fault_cost_times_first_touch_and_rewrite_as_held_memory_grows_then_releases_it(tmp_path):
    from async_ckpt.bench.fault_cost import measure

    for folder in (str(tmp_path), "anon"):
        result = measure(folder, 2, 1 << 20, touch_bytes=1 << 20, repeats=1)
        assert [row["held_bytes"] for row in result["rows"]] == [0, 1 << 20, 2 << 20, 0], folder
        assert result["rows"][-1]["released"] is True
        assert all(t["first_s"] > 0 and t["again_s"] > 0 for row in result["rows"] for t in row["touches"]), folder
    assert list(tmp_path.iterdir()) == []  # the held files and their folder are gone


def test_bench_records_the_systems_dirty_bytes_after_each_step_and_around_each_save(bench):
    _, report = bench
    for rank in report["ranks"]:
        assert all(isinstance(step["dirty_bytes"], int) for step in rank["steps"])
        for name, method in rank["methods"].items():
            if "skipped" not in method:
                assert all(isinstance(save[key], int) for save in method["saves"] for key in ("dirty_before", "dirty_after"))
                assert method["written_back"] in (True, False), name


def test_bench_records_the_machines_cpu_by_kind_in_each_step_and_charges_it_to_the_saves(bench):
    _, report = bench
    for rank in report["ranks"]:
        assert all(set(step["machine_cpu_s"]) == {"user", "system", "steal", "idle"} for step in rank["steps"])
        assert sum(step["machine_cpu_s"]["user"] for step in rank["steps"]) > 0
        assert all(set(save["machine_cpu_s"]) == {"user", "system", "steal", "idle"}  # each save's call too
                   for method in rank["methods"].values() for save in method.get("saves", []))
    for name, m in report["summary"]["methods"].items():
        if "skipped" not in m:
            assert m["extra_machine_cpu_per_save_s"] is None or set(m["extra_machine_cpu_per_save_s"]) == {
                "user", "system", "steal", "idle"}, name
    # every save call is costed, with or without steps inside its write
    assert set(report["summary"]["methods"]["async_ckpt"]["extra_machine_cpu_per_save_s"]) == {
        "user", "system", "steal", "idle"}


def test_bench_deletes_each_methods_checkpoints_before_the_next_method_trains(bench):
    out, report = bench
    for rank in report["ranks"]:
        assert all(isinstance(method["discard_s"], float) for method in rank["methods"].values()
                   if "skipped" not in method)
    if report["target"]["kind"] == "local":
        assert not any((out / "work").glob("*/global_step*")) and not any((out / "work").rglob("*.pt"))


def test_a_method_deletes_its_checkpoints_from_s3_once_measured(s3, bucket):
    from async_ckpt.bench.methods import Method

    client = s3.client()
    for key in ("run/async_ckpt/async_ckpt-0-0/mp_rank_00_model_states.pt", "run/async_ckpt/latest", "run/dcp/x"):
        client.put_object(Bucket=bucket, Key=key, Body=b"x")
    method = Method(None, {"kind": "s3", "storage_options": {"endpoint_url": s3.endpoint}}, 0)
    method.root = f"s3://{bucket}/run/async_ckpt"
    method.discard()
    left = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert left == ["run/dcp/x"]


def test_each_run_against_a_users_url_saves_under_a_new_folder_and_removes_it_at_the_end(s3, bucket, tmp_path):
    from async_ckpt.bench.save_bench import _start_target, stop_target

    cfg = BenchConfig.quick(url=f"s3://{bucket}/runs", endpoint=s3.endpoint, target="s3")
    first, server = _start_target(cfg, str(tmp_path))
    second, _ = _start_target(cfg, str(tmp_path))
    assert server is None and first["url"] != second["url"]
    assert all(t["url"].startswith(f"s3://{bucket}/runs/bench-") for t in (first, second))
    client = s3.client()
    for target in (first, second):
        client.put_object(Bucket=bucket, Key=target["url"].split("/", 3)[3] + "/stock/latest", Body=b"x")
    stop_target(first, None)
    left = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert left == [second["url"].split("/", 3)[3] + "/stock/latest"]


def test_bench_refuses_a_url_it_cannot_write_into_before_its_ranks_start(s3, tmp_path, monkeypatch):
    import async_ckpt.launch

    monkeypatch.setattr(async_ckpt.launch, "RankGroup", None)  # a run that started would fail on it
    with pytest.raises(UsageError, match="--url s3://no-such-bucket/runs: cannot write there.*--endpoint"):
        run(BenchConfig.quick(url="s3://no-such-bucket/runs", endpoint=s3.endpoint, target="s3",
                              out=str(tmp_path / "out")))


@pytest.mark.parametrize("overrides, error", [({"target": "s3", "endpoint": "http://127.0.0.1:9"}, "--endpoint"),
                                              ({"endpoint": "http://127.0.0.1:9"}, "--endpoint"),
                                              ({"out": "{tmp}/file"}, "is a file"),
                                              ({"out": "{tmp}/file/results"}, "cannot be made")])
def test_bench_refuses_arguments_it_would_ignore_or_fail_on_at_the_end_before_it_starts(overrides, error, tmp_path,
                                                                                      monkeypatch):
    import async_ckpt.launch

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(async_ckpt.launch, "RankGroup", None)  # a run that started would fail on it
    overrides = {k: v.format(tmp=tmp_path) for k, v in overrides.items()}
    with pytest.raises(UsageError, match=error):
        run(BenchConfig.quick(**{"out": str(tmp_path / "out"), **overrides}))
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_bench_writeback_cap_option_sets_how_long_a_method_trains_on_after_its_last_save():
    import argparse

    from async_ckpt.bench.save_bench import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--writeback-cap-s", "20"])).writeback_cap_s == 20.0
    assert config_from_args(parser.parse_args(["--quick"])).writeback_cap_s == 5.0
