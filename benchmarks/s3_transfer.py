"""S3 transfer throughput: async_ckpt's uploader and ranged downloader against boto3's TransferManager.

Same bytes, same endpoint, same run, alternating the clients so drift hits both alike. With no
``--endpoint`` a moto server is started on 127.0.0.1, in a process of its own.

    python -m benchmarks.s3_transfer --mib 512 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator

MiB = 1024 * 1024
BOTO3_CONCURRENCY = (4, 8, 16)  # boto3 is measured at each; its best is the floor


def _payload(nbytes: int) -> bytes:
    return bytes(bytearray(os.urandom(MiB)) * (nbytes // MiB))


def measure(endpoint: str, bucket: str, nbytes: int, repeats: int, part_size: int, concurrency: int,
            boto3_concurrency: tuple[int, ...] = BOTO3_CONCURRENCY) -> dict:
    """Median GB/s of each client; boto3 at every concurrency in ``boto3_concurrency``, its best counts."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    from async_ckpt.storage.s3 import S3Storage

    data = _payload(nbytes)
    client = boto3.client("s3", endpoint_url=endpoint)
    configs = {c: TransferConfig(multipart_chunksize=part_size, multipart_threshold=part_size, max_concurrency=c)
               for c in boto3_concurrency}
    storage = S3Storage(f"s3://{bucket}/xfer", {"endpoint_url": endpoint}, part_size=part_size,
                        max_concurrency=concurrency)
    runs: dict[str, list[float]] = {"async_ckpt_upload": [], "async_ckpt_download": []}
    for c in boto3_concurrency:
        runs[f"boto3_upload_x{c}"], runs[f"boto3_download_x{c}"] = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):  # the clients alternate, so drift on a shared machine hits all alike
            started = time.perf_counter()
            with storage.open_write(f"ours-{i}.bin") as stream:
                view = memoryview(data)
                for offset in range(0, len(data), 64 * MiB):  # torch.save hands over large buffers like this
                    stream.write(view[offset:offset + 64 * MiB])
            runs["async_ckpt_upload"].append(time.perf_counter() - started)
            for c, config in configs.items():
                started = time.perf_counter()
                client.upload_fileobj(io.BytesIO(data), bucket, f"xfer/boto-{i}-{c}.bin", Config=config)
                runs[f"boto3_upload_x{c}"].append(time.perf_counter() - started)
            started = time.perf_counter()
            storage.get_file(f"ours-{i}.bin", os.path.join(tmp, "ours.bin"))
            runs["async_ckpt_download"].append(time.perf_counter() - started)
            for c, config in configs.items():
                started = time.perf_counter()
                with open(os.path.join(tmp, "boto.bin"), "wb") as fh:
                    client.download_fileobj(bucket, f"xfer/boto-{i}-{c}.bin", fh, Config=config)
                runs[f"boto3_download_x{c}"].append(time.perf_counter() - started)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in runs.items()}
    best_up = max(boto3_concurrency, key=lambda c: gbps[f"boto3_upload_x{c}"])
    best_down = max(boto3_concurrency, key=lambda c: gbps[f"boto3_download_x{c}"])
    return {"bytes": nbytes, "part_size": part_size, "concurrency": concurrency, "repeats": repeats,
            "seconds": runs, "median_gbps": gbps,
            "boto3_best_upload_concurrency": best_up, "boto3_best_download_concurrency": best_down,
            "upload_ratio_vs_boto3": gbps["async_ckpt_upload"] / gbps[f"boto3_upload_x{best_up}"],
            "download_ratio_vs_boto3": gbps["async_ckpt_download"] / gbps[f"boto3_download_x{best_down}"],
            "uploader_peak_buffered_bytes": storage.stats.peak_buffered_bytes}


@contextlib.contextmanager
def moto_process() -> Iterator[str]:
    """A moto S3 server in its own process on 127.0.0.1 (in-process, it would share the clients' GIL)."""
    from async_ckpt.launch import free_port

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the moto server on {endpoint} did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--bucket", default="xfer-bench")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.endpoint is None:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(key, "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with contextlib.ExitStack() as stack:
        endpoint = args.endpoint or stack.enter_context(moto_process())
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
        if args.bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=args.bucket)
        result = measure(endpoint, args.bucket, args.mib * MiB, args.repeats, args.part_mib * MiB, args.concurrency)
    g = result["median_gbps"]
    print(f"{args.mib} MiB, parts of {args.part_mib} MiB x {args.concurrency} in flight, median of {args.repeats}:")
    up, down = result["boto3_best_upload_concurrency"], result["boto3_best_download_concurrency"]
    print(f"  upload   async_ckpt {g['async_ckpt_upload']:.3f} GB/s   boto3 TransferManager (best: x{up}) "
          f"{g[f'boto3_upload_x{up}']:.3f} GB/s   ratio {result['upload_ratio_vs_boto3']:.2f}x")
    print(f"  download async_ckpt {g['async_ckpt_download']:.3f} GB/s   boto3 download_fileobj (best: x{down}) "
          f"{g[f'boto3_download_x{down}']:.3f} GB/s   ratio {result['download_ratio_vs_boto3']:.2f}x")
    print("  boto3 by concurrency: " + ", ".join(f"x{c} up {g[f'boto3_upload_x{c}']:.3f} / down "
                                                   f"{g[f'boto3_download_x{c}']:.3f}" for c in BOTO3_CONCURRENCY))
    print(f"  uploader peak buffered: {result['uploader_peak_buffered_bytes'] / MiB:.0f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
