"""Storage backends on their own: atomic publication, identical bytes on every write path, clean failure."""

from __future__ import annotations

import base64
import datetime
import errno
import os
import subprocess
import sys
import threading
import time
import uuid
import zlib

import boto3
import fsspec
from fsspec.implementations.memory import MemoryFileSystem
import pytest
import torch

from async_ckpt.errors import ConfigError, MissingFileError, StorageError
from async_ckpt.serialization import write_torch_file
from async_ckpt.storage import LocalStorage, open_storage
from async_ckpt.storage import local as local_storage
from async_ckpt.storage import s3 as s3_storage
from async_ckpt.storage.local import DirectWriter, _open_direct
from async_ckpt.storage.s3 import S3Storage
from async_ckpt.storage.retry import RetryPolicy
from async_ckpt.bench.s3_transfer import server_process
from s3_server import FaultProxy, options

STATE = {"weights": torch.arange(1_000_003, dtype=torch.float32), "step": 7, "nested": [torch.ones(3, 5)]}


@pytest.mark.parametrize("url", ["s3://bucket/exp[1]", "s3://bucket/runs/*", "memory://root/what?"])
def test_an_object_store_root_with_glob_characters_is_refused(url):
    """fsspec deletes and moves by glob: retention in 's3://bucket/exp[1]' would delete 'exp1/...'."""
    with pytest.raises(ConfigError, match="glob pattern"):
        open_storage(url)


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "o_direct"])
def test_a_small_file_a_filling_disk_cuts_short_is_an_error_not_a_short_file(tmp_path, direct_io):
    """Past a file size limit, as on a disk that fills, one write takes what fits and says so only in its
    count: the manifest or 'latest' must then fail, not be published cut short."""
    script = f"""
import errno, resource, signal
from async_ckpt.storage import LocalStorage
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
try:
    LocalStorage({str(tmp_path)!r}, direct_io={direct_io}).write_bytes("manifest.json", b"x" * 20000)
except OSError as exc:
    print("raised", errno.errorcode[exc.errno])
else:
    print("returned")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["raised", "EFBIG"]
    assert not (tmp_path / "manifest.json").exists()


def test_a_filesystem_that_cannot_fsync_a_folder_is_written_with_a_warning(tmp_path, monkeypatch, caplog):
    """Some FUSE and virtual-machine shares answer a folder's fsync with EINVAL: every save failed there."""
    import stat

    fsync = os.fsync

    def no_folder_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return fsync(fd)

    monkeypatch.setattr(local_storage.os, "fsync", no_folder_fsync)
    monkeypatch.setattr(local_storage, "_warned_no_folder_fsync", set())
    with caplog.at_level("WARNING", logger="async_ckpt"):
        LocalStorage(str(tmp_path)).write_bytes("t/latest", b"t")
    assert (tmp_path / "t" / "latest").read_bytes() == b"t"
    assert "cannot fsync a folder" in caplog.text


def test_a_file_that_cannot_take_its_name_leaves_no_partial_file(tmp_path, monkeypatch):
    def no_room(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(local_storage.os, "replace", no_room)
    with pytest.raises(OSError, match="No space left"):
        LocalStorage(str(tmp_path)).write_bytes("t/manifest.json", b"{}")
    assert os.listdir(tmp_path / "t") == []


def test_a_local_write_makes_the_folders_it_creates_durable_in_their_parents(tmp_path, monkeypatch):
    """A tag folder's name must survive a crash as its files do: only 'latest' fsyncs the root otherwise."""
    synced = []
    real = local_storage.fsync_path
    monkeypatch.setattr(local_storage, "fsync_path", lambda path: synced.append(path) or real(path))
    root = tmp_path / "root"
    root.mkdir()
    LocalStorage(str(root)).write_bytes("tag/sub/file.bin", b"x")
    assert synced == [str(root), str(root / "tag"), str(root / "tag" / "sub")]


@pytest.mark.parametrize("direct_io", [True, False], ids=["o_direct", "buffered"])
def test_local_write_round_trips_unaligned_sizes(tmp_path, direct_io):
    storage = LocalStorage(str(tmp_path), direct_io=direct_io)
    entry = write_torch_file(storage, "tag/file.pt", STATE, tag_dir="tag", rank=0)
    assert entry.size == os.path.getsize(tmp_path / "tag" / "file.pt") and entry.size % 4096 != 0
    loaded = torch.load(tmp_path / "tag" / "file.pt")
    assert torch.equal(loaded["weights"], STATE["weights"]) and loaded["step"] == 7


def test_direct_and_buffered_writes_give_identical_bytes(tmp_path):
    write_torch_file(LocalStorage(str(tmp_path / "direct"), direct_io=True), "t/a.pt", STATE, tag_dir="t", rank=0)
    write_torch_file(LocalStorage(str(tmp_path / "buffered"), direct_io=False), "t/a.pt", STATE, tag_dir="t", rank=0)
    assert (tmp_path / "direct" / "t" / "a.pt").read_bytes() == (tmp_path / "buffered" / "t" / "a.pt").read_bytes()


def test_direct_writer_keeps_file_order_across_many_buffer_hand_offs(tmp_path):
    path = tmp_path / "f.bin"
    fd = _open_direct(str(path))
    if fd is None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    payload = os.urandom(10 * 8192 + 123)
    writer = DirectWriter(fd, buffer_bytes=8192)
    try:
        for start in range(0, len(payload), 3000):  # pieces that straddle the buffers
            writer.write(payload[start:start + 3000])
        writer.finish()
    finally:
        writer.release()
        os.close(fd)
    assert path.read_bytes() == payload


def test_direct_writer_writes_a_file_that_fits_one_buffer_on_the_calling_thread(tmp_path, monkeypatch):
    """A start mark or a manifest is not handed to an I/O thread that must first start and be scheduled."""
    path = tmp_path / "f.bin"
    fd = _open_direct(str(path))
    if fd is None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    writers = []
    write_all = local_storage.pwrite_all
    monkeypatch.setattr(local_storage, "pwrite_all",
                        lambda *args: writers.append(threading.current_thread()) or write_all(*args))
    payload = os.urandom(5000)
    writer = DirectWriter(fd, buffer_bytes=8192)
    try:
        writer.write(payload)
        writer.finish()
    finally:
        writer.release()
        os.close(fd)
    assert path.read_bytes() == payload and writers == [threading.current_thread()]


def test_a_retrys_backoff_leaves_the_process_wide_random_sequence_alone():
    """Training code's own random draws (and so a bitwise resume) must not depend on a background save's retries."""
    import random

    random.seed(7)
    expected = [random.random() for _ in range(3)]
    random.seed(7)
    delays = [RetryPolicy().delay(attempt) for attempt in range(5)]
    assert [random.random() for _ in range(3)] == expected and all(d >= 0 for d in delays)


@pytest.mark.parametrize("status,code,transient", [(503, "SlowDown", True), (500, "InternalError", True),
                                                     (501, "NotImplemented", False), (505, "", False),
                                                     (400, "BadDigest", True),
                                                     (403, "AccessDenied", False)])
def test_a_store_answer_is_retried_only_where_another_try_can_succeed(status, code, transient):
    """501: a store that does not implement a request (checksum headers, on some S3-compatible stores)."""
    from botocore.exceptions import ClientError

    from async_ckpt.storage.retry import is_transient

    error = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "UploadPart")
    assert is_transient(error) is transient


def test_a_retrys_backoff_stays_finite_however_many_attempts():
    assert 0 <= RetryPolicy(attempts=5000).delay(4999) <= RetryPolicy().max_delay_s


def test_direct_writer_raises_the_error_of_a_background_write(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # every write fails (EBADF), in the helper thread
    writer = DirectWriter(fd, buffer_bytes=8192, alignment=4096)  # no O_DIRECT probe: a write on this fd fails
    try:
        with pytest.raises(OSError) as raised:  # at a later write, or at the latest at finish
            writer.write(b"x" * 8192 * 3)
            writer.finish()
        assert raised.value.errno == errno.EBADF
    finally:
        writer.release()
        os.close(fd)


def test_a_removable_lock_excludes_every_holder_and_leaves_no_file(tmp_path):
    """A holder that waited on a lock file its previous holder unlinked must not enter beside one that locked
    the file created at the path since."""
    if not local_storage._locks_node_wide(str(tmp_path)):
        pytest.skip("pytest's temporary folders are on a filesystem other machines may mount: lock files stay")
    path = str(tmp_path / "locks" / "one.lock")
    inside, most, unheld, entries, guard = 0, 0, 0, 0, threading.Lock()

    def hold_often():
        nonlocal inside, most, unheld, entries
        for _ in range(30):
            with local_storage.file_lock(path, remove=True) as held:
                with guard:
                    unheld += not held
                    entries += 1
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.002)
                with guard:
                    inside -= 1

    holders = [threading.Thread(target=hold_often) for _ in range(4)]
    for thread in holders:
        thread.start()
    for thread in holders:
        thread.join()
    assert entries == 4 * 30 and most == 1 and unheld == 0
    assert os.listdir(tmp_path / "locks") == []


def test_a_removable_lock_keeps_its_file_on_a_filesystem_other_machines_mount(tmp_path, monkeypatch):
    """On NFS a client's cached name may still lead to an unlinked lock file: two holders could run at once."""
    monkeypatch.setattr(local_storage, "_locks_node_wide", lambda path: False)
    path = tmp_path / "locks" / "one.lock"
    with local_storage.file_lock(str(path), remove=True) as held:
        assert held
    assert path.is_file()


@pytest.mark.parametrize("direct_io", [True, False], ids=["o_direct", "buffered"])
def test_failed_local_write_publishes_nothing(tmp_path, direct_io):
    storage = LocalStorage(str(tmp_path), direct_io=direct_io)
    with pytest.raises(RuntimeError):
        with storage.open_write("tag/file.pt") as stream:
            stream.write(b"x" * 100_000)
            raise RuntimeError("serialization failed")
    assert os.listdir(tmp_path / "tag") == []


def test_a_direct_writer_that_cannot_be_built_leaves_no_file_and_no_open_descriptor(tmp_path, monkeypatch):
    def no_memory(fd, **options):
        raise MemoryError("no memory for the bounce buffers")

    monkeypatch.setattr(local_storage, "DirectWriter", no_memory)
    storage = LocalStorage(str(tmp_path), direct_io=True)
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(MemoryError):
        with storage.open_write("tag/file.pt"):
            pass
    assert os.listdir(tmp_path / "tag") == []
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_s3_write_round_trips_through_multipart(s3, bucket):
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024, max_concurrency=3)
    assert isinstance(storage, S3Storage)
    payload = os.urandom(12 * 1024 * 1024 + 17)
    with storage.open_write("tag/blob.bin") as stream:
        stream.write(payload)
    assert s3.client().get_object(Bucket=bucket, Key="run/tag/blob.bin")["Body"].read() == payload
    assert storage.stats.peak_buffered_bytes <= (3 + 1) * 5 * 1024 * 1024


def test_s3_objects_carry_the_crc32_of_their_bytes(s3, bucket):
    """Each part is sent with its CRC-32 and the store keeps them: S3 checks every part on arrival."""
    part = 5 * 1024 * 1024
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=part)
    multipart, single = os.urandom(2 * part + 3), b"small"
    for name, payload in (("multipart.bin", multipart), ("single.bin", single)):
        with storage.open_write(name) as stream:
            stream.write(payload)
    storage.close()
    crc = {name: s3.client().head_object(Bucket=bucket, Key=f"run/{name}", ChecksumMode="ENABLED")["ChecksumCRC32"]
           for name in ("multipart.bin", "single.bin")}
    part_crcs = b"".join(_crc32(multipart[i:i + part]) for i in range(0, len(multipart), part))
    assert base64.b64decode(crc["multipart.bin"].split("-")[0]) == _crc32(part_crcs)  # S3's composite checksum
    assert base64.b64decode(crc["single.bin"]) == _crc32(single)


def test_s3_checksums_are_left_out_when_the_client_sends_them_only_where_required(s3, bucket):
    opts = options(s3.endpoint, config_kwargs={"request_checksum_calculation": "when_required"})
    storage = open_storage(f"s3://{bucket}/run", opts, part_size=5 * 1024 * 1024)
    payload = os.urandom(11 * 1024 * 1024)
    with storage.open_write("multipart.bin") as stream:
        stream.write(payload)
    storage.close()
    head = s3.client().head_object(Bucket=bucket, Key="run/multipart.bin", ChecksumMode="ENABLED")
    assert "ChecksumCRC32" not in head
    assert s3.client().get_object(Bucket=bucket, Key="run/multipart.bin")["Body"].read() == payload


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")  # moto's self-signed certificate
def test_s3_write_and_ranged_read_round_trip_over_https(tmp_path):
    with server_process("moto-tls") as endpoint:  # real S3 is https: checksums go in a trailer, unsigned
        opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "client_kwargs": {"verify": False}}
        boto3.client("s3", endpoint_url=endpoint, verify=False, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="over-https")
        storage = open_storage("s3://over-https/run", opts, part_size=5 * 1024 * 1024)
        payload = os.urandom(11 * 1024 * 1024 + 7)
        with storage.open_write("multipart.bin") as stream:
            stream.write(payload)
        storage.write_bytes("single.bin", b"small")
        storage.get_file("multipart.bin", str(tmp_path / "multipart.bin"))
        assert storage.read_bytes("single.bin") == b"small"
        storage.close()
    assert (tmp_path / "multipart.bin").read_bytes() == payload


def _crc32(data: bytes) -> bytes:
    return zlib.crc32(data).to_bytes(4, "big")


def test_s3_upload_threads_run_while_uploading_and_stop_on_close(s3, bucket):
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024,
                           max_concurrency=3, upload_threads=8)
    before = _upload_threads()
    with storage.open_write("blob.bin") as stream:
        stream.write(os.urandom(11 * 1024 * 1024))
    assert len(_upload_threads() - before) == 3  # never more threads than parts in flight
    storage.close()
    assert _upload_threads() == before
    payload = os.urandom(6 * 1024 * 1024)
    storage.write_bytes("after-close.bin", payload)  # stays usable: clients reconnect, threads start again
    assert len(_upload_threads() - before) == 3
    assert storage.read_bytes("after-close.bin") == payload
    storage.close()
    assert _upload_threads() == before


def _upload_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("async_ckpt-s3-lane")}


def test_s3_parts_double_in_size_after_every_band_so_large_files_fit_in_s3s_part_limit(s3, bucket, monkeypatch):
    """PARTS_PER_SIZE is 1000 (16 GiB files at the default part size before the first doubling);
    two here, so that the doubling shows in a 30 MiB file."""
    monkeypatch.setattr(s3_storage, "PARTS_PER_SIZE", 2)
    mib = 1024 * 1024
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * mib, max_concurrency=2)
    payload = os.urandom(30 * mib + 3)
    with storage.open_write("tag/big.bin") as stream:
        for start in range(0, len(payload), 3 * mib + 1):  # ragged writes, across part boundaries
            stream.write(payload[start:start + 3 * mib + 1])
    client = s3.client()
    assert client.get_object(Bucket=bucket, Key="run/tag/big.bin")["Body"].read() == payload
    sizes = [client.head_object(Bucket=bucket, Key="run/tag/big.bin", PartNumber=n)["ContentLength"] for n in range(1, 6)]
    assert sizes == [5 * mib, 5 * mib, 10 * mib, 10 * mib, 3]


def test_s3_equal_parts_keep_every_part_but_the_last_at_part_size(s3, bucket, monkeypatch):
    """What Cloudflare R2 and Garage need: no doubling, where it would come after two parts here."""
    monkeypatch.setattr(s3_storage, "PARTS_PER_SIZE", 2)
    mib = 1024 * 1024
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * mib, equal_parts=True)
    payload = os.urandom(16 * mib + 3)
    with storage.open_write("tag/big.bin") as stream:
        stream.write(payload)
    client = s3.client()
    assert client.get_object(Bucket=bucket, Key="run/tag/big.bin")["Body"].read() == payload
    sizes = [client.head_object(Bucket=bucket, Key="run/tag/big.bin", PartNumber=n)["ContentLength"] for n in range(1, 5)]
    assert sizes == [5 * mib, 5 * mib, 5 * mib, mib + 3]


def test_s3_file_past_the_part_limit_fails_naming_the_fix_and_leaves_no_upload(s3, bucket, monkeypatch):
    monkeypatch.setattr(s3_storage, "MAX_PARTS", 2)
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024)
    with pytest.raises(StorageError, match="more than S3's 2 parts.*raise part_size"):
        with storage.open_write("tag/blob.bin") as stream:
            stream.write(os.urandom(16 * 1024 * 1024))
    assert s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_failed_s3_write_aborts_its_multipart_upload(s3, bucket):
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024)
    with pytest.raises(RuntimeError):
        with storage.open_write("tag/blob.bin") as stream:
            stream.write(os.urandom(11 * 1024 * 1024))
            raise RuntimeError("serialization failed")
    client = s3.client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="run/tag/")


def _uploading(storage, payload: bytes) -> tuple[threading.Thread, list[BaseException]]:
    """``payload`` being written to ``tag/blob.bin`` on a thread of its own; the errors it raised."""
    errors: list[BaseException] = []

    def upload() -> None:
        try:
            with storage.open_write("tag/blob.bin") as stream:
                stream.write(payload)
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            errors.append(exc)

    writer = threading.Thread(target=upload)
    writer.start()
    return writer, errors


def _held(proxy: FaultProxy, count: int, timeout_s: float) -> int:
    """The requests the proxy holds once ``count`` are, or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while proxy.held < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return proxy.held


def test_s3_close_during_an_upload_fails_the_upload_rather_than_hanging_it(s3, bucket):
    proxy = FaultProxy(s3.endpoint)
    proxy.hold = "run/tag/blob.bin"  # part uploads hang: they are in flight when close() comes
    storage = open_storage(f"s3://{bucket}/run", options(proxy.endpoint), part_size=5 * 1024 * 1024)
    writer, errors = _uploading(storage, os.urandom(11 * 1024 * 1024))
    try:
        _held(proxy, 2, 30)
        storage.close()
        writer.join(timeout=60)
        assert not writer.is_alive()
        assert [type(e) for e in errors] == [StorageError] and "run/tag/blob.bin" in str(errors[0])
    finally:
        proxy.stop()
        writer.join(timeout=60)
        storage.close()
    assert s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_s3_sends_max_concurrency_parts_at_once_on_one_lane_beyond_botocores_ten_connections(s3, bucket):
    proxy = FaultProxy(s3.endpoint)
    proxy.hold = "run/tag/blob.bin"  # every part hangs until healed: those in flight at once are counted
    storage = open_storage(f"s3://{bucket}/run", options(proxy.endpoint), part_size=5 * 1024 * 1024,
                           max_concurrency=12, upload_threads=1)
    payload = os.urandom(12 * 5 * 1024 * 1024 + 1)
    writer, errors = _uploading(storage, payload)
    try:
        in_flight = _held(proxy, 12, 15)
        proxy.heal()
        writer.join(timeout=120)
        assert in_flight == 12 and not writer.is_alive() and errors == []
        assert s3.client().get_object(Bucket=bucket, Key="run/tag/blob.bin")["Body"].read() == payload
    finally:
        proxy.stop()
        writer.join(timeout=60)
        storage.close()


def test_s3_upload_going_on_after_close_fails_rather_than_starting_upload_threads_again(s3, bucket):
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024)
    before = _upload_threads()  # of storages earlier tests left to the garbage collector
    with pytest.raises(StorageError, match="closed while an upload was still running"):
        with storage.open_write("tag/blob.bin") as stream:
            stream.write(os.urandom(6 * 1024 * 1024))  # the first part is sent
            storage.close()
            stream.write(os.urandom(6 * 1024 * 1024))
    assert _upload_threads() - before == set()
    assert s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.parametrize("part_size", [16 * 1024 * 1024, 32 * 1024 * 1024], ids=["part", "whole-object-put"])
def test_s3_body_the_store_stops_reading_is_given_up_and_sent_again(s3, bucket, monkeypatch, part_size):
    """botocore's read timeout starts once the body is sent; a body the store stops reading mid-way
    would otherwise hold the upload until TCP gives up, or for ever. 16 MiB: more than the loopback
    socket buffers take while the store reads nothing; one part, or one PUT under a larger part size."""
    monkeypatch.setattr(s3_storage, "SLOWEST_PART_BYTES_PER_S", 16 * 1024 * 1024)  # a deadline of 3 s here
    proxy = FaultProxy(s3.endpoint)
    proxy.fail_next_parts(1, kind="unread")
    opts = options(proxy.endpoint, config_kwargs={"read_timeout": 1.0, "connect_timeout": 1.0})
    storage = open_storage(f"s3://{bucket}/run", opts, part_size=part_size,
                           retry=RetryPolicy(attempts=3, base_delay_s=0.05))
    payload = os.urandom(16 * 1024 * 1024)
    outcome: list[BaseException | None] = []

    def upload() -> None:
        try:
            with storage.open_write("tag/blob.bin") as stream:
                stream.write(payload)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            outcome.append(exc)

    writer = threading.Thread(target=upload)
    try:
        writer.start()
        writer.join(timeout=60)
        assert not writer.is_alive(), "the upload still waits for the part the store stopped reading"
        assert outcome == [None] and proxy.injected == 1
        assert s3.client().get_object(Bucket=bucket, Key="run/tag/blob.bin")["Body"].read() == payload
    finally:
        proxy.stop()
        writer.join(timeout=60)
        storage.close()


def test_s3_ranged_download_reassembles_the_object(s3, bucket, tmp_path):
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024)
    payload = os.urandom(11 * 1024 * 1024 + 5)
    storage.write_bytes("blob.bin", payload)
    storage.get_file("blob.bin", str(tmp_path / "blob.bin"))
    assert (tmp_path / "blob.bin").read_bytes() == payload
    assert storage.stats.bytes_downloaded == len(payload)


def _download_while(s3, bucket, tmp_path, change, *, times: int = 1, reported: list | None = None) -> bytes:
    """Download a three-part object one part at a time, calling ``change(client, key, n)`` from the progress
    callback (once a part is in, as far as the download has not reached before) the first ``times`` times;
    return the file downloaded. ``reported`` collects what the progress got."""
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024, max_concurrency=1)
    storage.write_bytes("blob.bin", b"a" * _BLOB)
    changed = []

    def after_a_part(nbytes: int) -> None:
        if reported is not None:
            reported.append(nbytes)
        if len(changed) < times:
            changed.append(change(s3.client(), "run/blob.bin", len(changed)))

    storage.get_file("blob.bin", str(tmp_path / "blob.bin"), progress=after_a_part)
    return (tmp_path / "blob.bin").read_bytes()


_BLOB = 15 * 1024 * 1024


def _replace(bucket):
    def replace(client, key, n):
        client.put_object(Bucket=bucket, Key=key, Body=b"bc"[n % 2:n % 2 + 1] * _BLOB)
    return replace


def test_s3_object_replaced_while_downloaded_is_downloaded_again_whole_never_mixed(s3, bucket, tmp_path):
    reported = []
    assert _download_while(s3, bucket, tmp_path, _replace(bucket), reported=reported) == b"b" * _BLOB
    assert sum(reported) == _BLOB  # each byte once, though the first part was fetched twice


def test_s3_object_replaced_during_both_downloads_fails_naming_it(s3, bucket, tmp_path):
    with pytest.raises(StorageError, match=r"blob.bin was replaced while it was downloaded, twice"):
        _download_while(s3, bucket, tmp_path, _replace(bucket), times=2)


def test_s3_object_deleted_while_downloaded_is_a_missing_file_naming_it(s3, bucket, tmp_path):
    with pytest.raises(MissingFileError, match=r"run/blob.bin was deleted while it was downloaded"):
        _download_while(s3, bucket, tmp_path, lambda client, key, n: client.delete_object(Bucket=bucket, Key=key))


def test_s3_download_denied_for_a_key_names_both_causes_s3_gives_a_403_for(s3, bucket, tmp_path):
    proxy = FaultProxy(s3.endpoint)
    proxy.no_list_permission = True
    storage = open_storage(f"s3://{bucket}/run", options(proxy.endpoint))
    try:
        with pytest.raises(StorageError, match=r"run/missing.bin was denied \(403\).*s3:GetObject.*s3:ListBucket"):
            storage.get_file("missing.bin", str(tmp_path / "missing.bin"))
    finally:
        storage.close()
        proxy.stop()


def test_s3_read_denied_for_a_key_is_a_permission_error_naming_it(s3, bucket):
    proxy = FaultProxy(s3.endpoint)
    proxy.no_list_permission = True
    storage = open_storage(f"s3://{bucket}/run", options(proxy.endpoint))
    try:
        with pytest.raises(PermissionError, match=r"s3:GetObject.*s3:ListBucket.*run/latest"):
            storage.read_bytes("latest")
    finally:
        storage.close()
        proxy.stop()


def test_a_failed_write_to_an_fsspec_store_uploads_nothing_once_its_stream_is_freed():
    """fsspec's base discard() does nothing; a buffered file's __del__ closes it, uploading its buffer."""
    import gc

    from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

    from async_ckpt.storage.fsspec_store import FsspecStorage

    uploaded: dict[str, bytes] = {}

    class Buffered(AbstractBufferedFile):
        def _initiate_upload(self):
            pass

        def _upload_chunk(self, final=False):
            uploaded[self.path] = uploaded.get(self.path, b"") + self.buffer.getvalue()
            return True

    class Store(AbstractFileSystem):
        protocol = "uploads"

        def _open(self, path, mode="rb", **kwargs):
            return Buffered(self, path, mode, **kwargs)

        def makedirs(self, path, exist_ok=False):
            pass

        def rm(self, path, recursive=False, maxdepth=None):
            uploaded.pop(path, None)

    storage = FsspecStorage(Store(), "bucket/run", "uploads://bucket/run")
    try:
        with storage.open_write("t/x.bin") as stream:
            stream.write(b"half of a file")
            raise OSError("the write failed (injected)")
    except OSError:
        pass
    del stream
    gc.collect()
    assert uploaded == {}


def test_an_s3_folder_marker_object_is_no_child_of_its_folder(s3, bucket):
    """The S3 console's "Create folder", Hadoop's S3A and rclone leave a zero-byte ``prefix/`` object."""
    s3.client().put_object(Bucket=bucket, Key="run/global_step5/", Body=b"")
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint))
    try:
        storage.write_bytes("global_step5/a.bin", b"a")
        assert storage.list_dir("global_step5") == ["a.bin"]
        assert list(storage.iter_files("global_step5")) == ["global_step5/a.bin"]
    finally:
        storage.close()


def test_s3_listing_survives_transient_server_errors(s3, bucket):
    """s3fs's own requests (listings, HEADs, deletes) retry 5xx as botocore does."""
    proxy = FaultProxy(s3.endpoint)
    storage = open_storage(f"s3://{bucket}/run", options(proxy.endpoint))
    try:
        storage.write_bytes("tag/a.bin", b"a")
        proxy.fail_next_listings(2)
        assert storage.list_dir("tag") == ["a.bin"] and proxy.injected == 2
    finally:
        storage.close()
        proxy.stop()


@pytest.mark.parametrize("kind", ["503", "429", "reset", "stall"])
def test_s3_upload_survives_transient_part_faults(s3, bucket, kind):
    proxy = FaultProxy(s3.endpoint)
    proxy.stall_s = 3.0
    try:
        proxy.fail_next_parts(2, kind=kind)
        opts = options(proxy.endpoint, config_kwargs={"read_timeout": 1.0, "connect_timeout": 2})
        storage = open_storage(f"s3://{bucket}/run", opts, part_size=5 * 1024 * 1024,
                               retry=RetryPolicy(attempts=6, base_delay_s=0.05))
        payload = os.urandom(11 * 1024 * 1024)
        with storage.open_write("tag/blob.bin") as stream:
            stream.write(payload)
        assert proxy.injected == 2
        assert s3.client().get_object(Bucket=bucket, Key="run/tag/blob.bin")["Body"].read() == payload
    finally:
        proxy.stop()


def _write_with_lost_completion(s3, bucket, *, relayed: bool) -> tuple[FaultProxy, bytes]:
    """Write an 11 MiB object through a proxy that loses the answer to its completion (after
    passing it on, if ``relayed``) and answers the retry NoSuchUpload, as MinIO and Ceph do."""
    proxy = FaultProxy(s3.endpoint)
    proxy.lose_next_completion(relay=relayed)
    storage = open_storage(f"s3://{bucket}/run", options(proxy.endpoint), part_size=5 * 1024 * 1024,
                           retry=RetryPolicy(attempts=3, base_delay_s=0.05))
    payload = os.urandom(11 * 1024 * 1024)
    try:
        with storage.open_write("tag/blob.bin") as stream:
            stream.write(payload)
    finally:
        storage.close()
        proxy.stop()
    return proxy, payload


def test_s3_completion_whose_answer_was_lost_succeeds_when_the_store_holds_the_joined_parts(s3, bucket):
    proxy, payload = _write_with_lost_completion(s3, bucket, relayed=True)
    assert proxy.injected == 1
    assert s3.client().get_object(Bucket=bucket, Key="run/tag/blob.bin")["Body"].read() == payload


def test_s3_completion_answered_no_such_upload_with_no_object_there_fails(s3, bucket):
    with pytest.raises(StorageError, match="NoSuchUpload"):
        _write_with_lost_completion(s3, bucket, relayed=False)
    client = s3.client()
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="run/tag/")
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def test_s3_completion_failing_for_another_cause_than_the_parts_after_they_grew_does_not_point_at_equal_parts(
        s3, bucket, monkeypatch):
    monkeypatch.setattr(s3_storage, "PARTS_PER_SIZE", 1)  # the 11 MiB file's second part is 10 MiB
    with pytest.raises(StorageError, match="NoSuchUpload") as raised:
        _write_with_lost_completion(s3, bucket, relayed=False)
    assert "equal_parts" not in str(raised.value)
    client = s3.client()
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def test_s3_upload_that_keeps_timing_out_fails_naming_the_object_and_aborts(s3, bucket):
    proxy = FaultProxy(s3.endpoint)
    proxy.stall_s = 3.0
    try:
        proxy.fail_all_parts(kind="stall")
        opts = options(proxy.endpoint, config_kwargs={"read_timeout": 1.0, "connect_timeout": 2})
        storage = open_storage(f"s3://{bucket}/run", opts, part_size=5 * 1024 * 1024,
                               retry=RetryPolicy(attempts=2, base_delay_s=0.05))
        with pytest.raises(StorageError, match="run/tag/blob.bin") as raised:
            with storage.open_write("tag/blob.bin") as stream:
                stream.write(os.urandom(11 * 1024 * 1024))
        assert "timeout" in str(raised.value).lower()
    finally:
        proxy.stop()
    client = s3.client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="run/tag/")


def test_s3_upload_whose_abort_is_refused_fails_with_its_own_error_and_warns_of_the_parts_left(s3, bucket, caplog):
    proxy = FaultProxy(s3.endpoint)
    proxy.deny_aborts = True
    try:
        proxy.fail_all_parts()
        storage = open_storage(f"s3://{bucket}/run", options(proxy.endpoint), part_size=5 * 1024 * 1024,
                               retry=RetryPolicy(attempts=1))
        with pytest.raises(StorageError, match="SlowDown"):
            with storage.open_write("tag/blob.bin") as stream:
                stream.write(os.urandom(11 * 1024 * 1024))
        storage.close()
    finally:
        proxy.stop()
    assert "could not abort the multipart upload of s3://" in caplog.text and "AccessDenied" in caplog.text
    uploads = s3.client().list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert [u["Key"] for u in uploads] == ["run/tag/blob.bin"]
    s3.client().abort_multipart_upload(Bucket=bucket, Key="run/tag/blob.bin", UploadId=uploads[0]["UploadId"])


@pytest.mark.parametrize("recursive", [False, True])
def test_s3_delete_that_the_store_refuses_raises_naming_what_is_left(s3, bucket, recursive):
    """S3 answers a refused DeleteObjects key inside a 200 response, which s3fs does not raise on."""
    proxy = FaultProxy(s3.endpoint)
    proxy.refuse_deletes = True
    storage = open_storage(f"s3://{bucket}/run", options(proxy.endpoint))
    try:
        storage.write_bytes("tag/.async_ckpt/started-rank0", b"x")
        with pytest.raises(PermissionError, match="S3 kept 1 object.*refused"):
            storage.delete("tag/.async_ckpt" if recursive else "tag/.async_ckpt/started-rank0", recursive=recursive)
        proxy.refuse_deletes = False
        storage.delete("tag", recursive=True)
        assert "Contents" not in s3.client().list_objects_v2(Bucket=bucket, Prefix="run/tag/")
    finally:
        storage.close()
        proxy.stop()


class _NeedsAMissingLibrary(fsspec.AbstractFileSystem):
    """A backend that imports its client library only when opened, as fsspec's hdfs:// does."""

    protocol = "needs-a-missing-library"

    def __init__(self, **options):
        raise ModuleNotFoundError("No module named 'missing_client_library'")


def test_a_backend_whose_client_library_is_missing_is_a_config_error_naming_it():
    fsspec.register_implementation(_NeedsAMissingLibrary.protocol, _NeedsAMissingLibrary, clobber=True)
    with pytest.raises(ConfigError, match="missing_client_library'. Install what the fsspec backend"):
        open_storage(f"{_NeedsAMissingLibrary.protocol}://host/run")


class _HostFromUrl(MemoryFileSystem):
    """A backend that takes its server from the URL, as fsspec's hdfs://, webhdfs:// and ftp:// do."""

    protocol = "host-from-url"
    cachable = False

    def __init__(self, host: str = "default", **options):
        super().__init__(**options)
        self.host = host

    @staticmethod
    def _get_kwargs_from_urls(path):
        return {"host": path.split("://", 1)[1].split("/", 1)[0]}


@pytest.mark.parametrize("options,host", [({}, "nn2"), ({"host": "given"}, "given")])
def test_a_backend_gets_the_server_its_url_names_unless_storage_options_name_one(options, host):
    fsspec.register_implementation(_HostFromUrl.protocol, _HostFromUrl, clobber=True)
    assert open_storage(f"{_HostFromUrl.protocol}://nn2/run", options).fs.host == host


def test_a_password_in_the_url_is_left_out_of_the_storages_name_in_logs_and_errors():
    fsspec.register_implementation(_HostFromUrl.protocol, _HostFromUrl, clobber=True)
    storage = open_storage(f"{_HostFromUrl.protocol}://user:secret@nn2/run")
    assert storage.url == f"{_HostFromUrl.protocol}://user:***@nn2/run" and "secret" in storage.fs.host


class _RenameKeepsAnExistingFile(MemoryFileSystem):
    """A filesystem whose rename onto an existing file does nothing and says nothing (WebHDFS answers false)."""

    protocol = "rename-keeps"
    cachable = False

    def mv(self, path1, path2, **kwargs):
        if not self.exists(path2):
            super().mv(path1, path2, **kwargs)


def test_a_write_that_a_rename_does_not_publish_fails_and_leaves_no_partial_file():
    fsspec.register_implementation(_RenameKeepsAnExistingFile.protocol, _RenameKeepsAnExistingFile, clobber=True)
    storage = open_storage(f"{_RenameKeepsAnExistingFile.protocol}://{uuid.uuid4().hex}/run")
    storage.write_bytes("latest", b"first")
    with pytest.raises(OSError, match="does not replace a file by a rename"):
        storage.write_bytes("latest", b"second")
    assert storage.list_dir() == ["latest"] and storage.read_bytes("latest") == b"first"


class _CachesListings(MemoryFileSystem):
    """A filesystem that answers a listing from its cache until told to drop it, as gcsfs and adlfs do."""

    protocol = "caches-listings"
    cachable = False

    def __init__(self, **options):
        super().__init__(**options)
        self.listings: dict[str, list] = {}

    def ls(self, path, detail=False, **kwargs):
        key = self._strip_protocol(path)
        if key not in self.listings:
            self.listings[key] = super().ls(path, detail=detail, **kwargs)
        return self.listings[key]

    def exists(self, path, **kwargs):
        parent = self._parent(path)
        if parent in self.listings:
            return any(name.rstrip("/") == self._strip_protocol(path) for name in self.listings[parent])
        return super().exists(path, **kwargs)

    def invalidate_cache(self, path=None):
        self.listings.clear() if path is None else self.listings.pop(self._strip_protocol(path), None)


def test_listings_and_lookups_see_what_another_process_wrote_since():
    fsspec.register_implementation(_CachesListings.protocol, _CachesListings, clobber=True)
    url = f"{_CachesListings.protocol}://{uuid.uuid4().hex}/run"
    reader, writer = open_storage(url), open_storage(url)  # two ranks' clients of one folder
    writer.write_bytes("tag/a.pt", b"x")
    assert reader.list_dir("tag") == ["a.pt"] and not reader.exists("tag/b.pt")
    writer.write_bytes("tag/b.pt", b"x")
    assert reader.exists("tag/b.pt")
    assert reader.list_dir("tag") == ["a.pt", "b.pt"]


class _TimesAs(MemoryFileSystem):
    """A filesystem whose ``info`` gives a file's time in the field ``key`` alone (or none)."""

    protocol = "times-as"
    cachable = False
    key: str | None = None
    value: object = None

    def info(self, path, **kwargs):
        details = {k: v for k, v in super().info(path, **kwargs).items() if k != "created"}
        return {**details, self.key: self.value} if self.key else details


@pytest.mark.parametrize("key,value", [("last_modified", datetime.datetime(2020, 1, 2, tzinfo=datetime.timezone.utc)),
                                       ("updated", "2020-01-02T00:00:00.000Z"), ("modificationTime", 1577923200000)])
def test_a_files_time_is_read_from_the_field_its_backend_gives_it_in(key, value, monkeypatch):
    fsspec.register_implementation(_TimesAs.protocol, _TimesAs, clobber=True)
    monkeypatch.setattr(_TimesAs, "key", key)
    monkeypatch.setattr(_TimesAs, "value", value)
    storage = open_storage(f"{_TimesAs.protocol}://{uuid.uuid4().hex}/run")
    storage.write_bytes("a", b"x")
    assert storage.modified("a") == 1577923200.0


def test_a_file_whose_time_the_backend_does_not_give_counts_as_changed_now(monkeypatch):
    """So gc takes it for one being written, never for an abandoned one from 1970."""
    fsspec.register_implementation(_TimesAs.protocol, _TimesAs, clobber=True)
    storage = open_storage(f"{_TimesAs.protocol}://{uuid.uuid4().hex}/run")
    storage.write_bytes("a", b"x")
    assert abs(storage.modified("a") - time.time()) < 60


@pytest.mark.parametrize("options,names", [({"endpoint": "http://127.0.0.1:9"}, "unexpected keyword argument 'endpoint'"),
                                           ({"config_kwargs": "x"}, r"config_kwargs'\] must be a dict")])
def test_s3_options_that_the_client_refuses_are_a_config_error_when_opened(options, names):
    with pytest.raises(ConfigError, match=names):
        open_storage("s3://bucket/run", options)


@pytest.mark.parametrize("options,names", [({"key": "only-the-key"}, "PartialCredentialsError"),
                                           ({"profile": "no-such-profile-here"}, "ProfileNotFound")])
def test_s3_credentials_botocore_cannot_resolve_are_a_storage_error_when_opened(options, names):
    with pytest.raises(StorageError, match=f"cannot open s3://bucket/run: {names}.*Check the credentials"):
        open_storage("s3://bucket/run", options)


def test_s3_download_into_a_full_disk_names_the_local_folder_not_the_network(s3, bucket, tmp_path, monkeypatch):
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024)
    storage.write_bytes("small.bin", b"x" * 1000)

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(s3_storage.os, "pwrite", disk_full)
    with pytest.raises(StorageError, match=r"cannot write .*small.bin.*No space left on device. Free space in that "
                                           r"folder \(on resume: cache_dir\)"):
        storage.get_file("small.bin", str(tmp_path / "small.bin"))


@pytest.mark.parametrize("size", [1000, 12 * 1024 * 1024], ids=["one_put", "multipart"])
def test_s3_requests_carry_the_server_side_encryption_given_in_storage_options(s3, bucket, tmp_path, size):
    extra = {"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}}
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint, **extra), part_size=5 * 1024 * 1024)
    payload = os.urandom(size)
    storage.write_bytes("enc.bin", payload)
    head = s3.client().head_object(Bucket=bucket, Key="run/enc.bin")
    assert head["ServerSideEncryption"] == "AES256" and head["ContentLength"] == size
    storage.get_file("enc.bin", str(tmp_path / "enc.bin"))
    assert (tmp_path / "enc.bin").read_bytes() == payload


def test_s3_download_completes_a_part_that_one_write_took_only_some_of(s3, bucket, tmp_path, monkeypatch):
    """Linux writes at most 2 GiB less a page per pwrite, and a filling disk may take part of a write."""
    storage = open_storage(f"s3://{bucket}/run", options(s3.endpoint), part_size=5 * 1024 * 1024)
    payload = os.urandom(3000)
    storage.write_bytes("part.bin", payload)
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: pwrite(fd, memoryview(data)[:1000], offset))
    storage.get_file("part.bin", str(tmp_path / "part.bin"))
    assert (tmp_path / "part.bin").read_bytes() == payload


def test_a_local_file_that_cannot_be_read_fails_its_check_rather_than_the_verification(tmp_path, monkeypatch):
    """An I/O error on one file (or the file gone after its size was read): that file is BAD, the others checked."""
    from async_ckpt import verify
    from async_ckpt.manifest import FileEntry

    (tmp_path / "f.pt").write_bytes(b"abc")
    entry = FileEntry("f.pt", 3, "352441c2", 0)
    assert verify.check_local_file(str(tmp_path / "f.pt"), entry).ok

    def failing_open(path, mode="r", *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(verify, "open", failing_open, raising=False)
    check = verify.check_local_file(str(tmp_path / "f.pt"), entry)
    assert not check.ok and check.problem == "unreadable (Input/output error)"
