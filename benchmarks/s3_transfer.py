"""S3 transfer throughput: async_ckpt's uploader and ranged downloader against boto3's TransferManager.

Same bytes, same endpoint, same run, alternating the clients so drift hits both alike. With no
``--endpoint`` an embedded moto server on 127.0.0.1 is used.

    python -m benchmarks.s3_transfer --mib 512 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import tempfile
import time

MiB = 1024 * 1024


def _payload(nbytes: int) -> bytes:
    return bytes(bytearray(os.urandom(MiB)) * (nbytes // MiB))


def measure(endpoint: str, bucket: str, nbytes: int, repeats: int, part_size: int, concurrency: int) -> dict:
    import boto3
    from boto3.s3.transfer import TransferConfig

    from async_ckpt.storage.s3 import S3Storage

    data = _payload(nbytes)
    client = boto3.client("s3", endpoint_url=endpoint)
    config = TransferConfig(multipart_chunksize=part_size, multipart_threshold=part_size, max_concurrency=concurrency)
    storage = S3Storage(f"s3://{bucket}/xfer", {"endpoint_url": endpoint}, part_size=part_size,
                        max_concurrency=concurrency)
    runs: dict[str, list[float]] = {"async_ckpt_upload": [], "boto3_upload": [], "async_ckpt_download": [],
                                    "boto3_download": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            started = time.perf_counter()
            with storage.open_write(f"ours-{i}.bin") as stream:
                view = memoryview(data)
                for offset in range(0, len(data), 64 * MiB):  # torch.save hands over large buffers like this
                    stream.write(view[offset:offset + 64 * MiB])
            runs["async_ckpt_upload"].append(time.perf_counter() - started)
            started = time.perf_counter()
            client.upload_fileobj(io.BytesIO(data), bucket, f"xfer/boto-{i}.bin", Config=config)
            runs["boto3_upload"].append(time.perf_counter() - started)
            started = time.perf_counter()
            storage.get_file(f"ours-{i}.bin", os.path.join(tmp, "ours.bin"))
            runs["async_ckpt_download"].append(time.perf_counter() - started)
            started = time.perf_counter()
            with open(os.path.join(tmp, "boto.bin"), "wb") as fh:
                client.download_fileobj(bucket, f"xfer/boto-{i}.bin", fh, Config=config)
            runs["boto3_download"].append(time.perf_counter() - started)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in runs.items()}
    return {"bytes": nbytes, "part_size": part_size, "concurrency": concurrency, "repeats": repeats,
            "seconds": runs, "median_gbps": gbps,
            "upload_ratio_vs_boto3": gbps["async_ckpt_upload"] / gbps["boto3_upload"],
            "download_ratio_vs_boto3": gbps["async_ckpt_download"] / gbps["boto3_download"],
            "uploader_peak_buffered_bytes": storage.stats.peak_buffered_bytes}


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
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        from moto.server import ThreadedMotoServer

        from async_ckpt.launch import free_port

        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(key, "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
        if args.bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=args.bucket)
        result = measure(endpoint, args.bucket, args.mib * MiB, args.repeats, args.part_mib * MiB, args.concurrency)
    finally:
        if server is not None:
            server.stop()
    g = result["median_gbps"]
    print(f"{args.mib} MiB, parts of {args.part_mib} MiB x {args.concurrency} in flight, median of {args.repeats}:")
    print(f"  upload   async_ckpt {g['async_ckpt_upload']:.3f} GB/s   boto3 TransferManager {g['boto3_upload']:.3f} GB/s"
          f"   ratio {result['upload_ratio_vs_boto3']:.2f}x")
    print(f"  download async_ckpt {g['async_ckpt_download']:.3f} GB/s   boto3 download_fileobj {g['boto3_download']:.3f} GB/s"
          f"   ratio {result['download_ratio_vs_boto3']:.2f}x")
    print(f"  uploader peak buffered: {result['uploader_peak_buffered_bytes'] / MiB:.0f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
