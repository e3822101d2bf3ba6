"""S3 transfer throughput: async_ckpt's uploader and ranged downloader against boto3's TransferManager.

Same bytes, same endpoint, same run, alternating the clients so drift hits both alike. Both
clients are measured at every concurrency of ``CONCURRENCY`` (parts in flight) and each one's
best counts; async_ckpt's default (8) is reported too. Each object is deleted once measured, so
the server's memory stays flat.

``--server moto`` (default, when no ``--endpoint``) starts a moto server on 127.0.0.1 in a process
of its own (``moto-tls``: the same over https, as real S3 is); ``--server null`` starts :mod:`async_ckpt.bench.null_s3`, which drops what it receives, so
the client is the bottleneck (uploads only).

    python -m async_ckpt.bench.s3_transfer --mib 256 --repeats 5
    python -m async_ckpt.bench.s3_transfer --server moto-tls --mib 256 --repeats 5
    python -m async_ckpt.bench.s3_transfer --server null --mib 512 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator

MiB = 1024 * 1024
CONCURRENCY = (4, 8, 16)  # both clients are measured at each; each one's best counts
DEFAULT_CONCURRENCY = 8  # async_ckpt's default max_concurrency


def _payload(nbytes: int) -> bytes:
    return bytes(bytearray(os.urandom(MiB)) * (nbytes // MiB))


def _best(gbps: dict[str, float], prefix: str, concurrency: tuple[int, ...]) -> int:
    return max(concurrency, key=lambda c: gbps[f"{prefix}_x{c}"])


def measure(endpoint: str, bucket: str, nbytes: int, repeats: int, part_size: int, upload_threads: int = 4,
            concurrency: tuple[int, ...] = CONCURRENCY, download: bool = True, verify: bool = True) -> dict:
    """Median GB/s of each client at each concurrency, and the ratios of the two clients' bests."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    from async_ckpt.storage.s3 import S3Storage

    data = _payload(nbytes)
    client = boto3.client("s3", endpoint_url=endpoint, verify=verify)
    configs = {c: TransferConfig(multipart_chunksize=part_size, multipart_threshold=part_size, max_concurrency=c)
               for c in concurrency}
    options = {"endpoint_url": endpoint, "client_kwargs": {"verify": verify}}
    storages = {c: S3Storage(f"s3://{bucket}/xfer", options, part_size=part_size,
                             max_concurrency=c, upload_threads=upload_threads) for c in concurrency}
    directions = ("upload", "download") if download else ("upload",)
    runs: dict[str, list[float]] = {f"{who}_{d}_x{c}": [] for who in ("async_ckpt", "boto3")
                                    for d in directions for c in concurrency}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as closing:
        for storage in storages.values():
            closing.callback(storage.close)
        for i in range(repeats):  # the clients alternate, so drift on a shared machine hits all alike
            for c in concurrency:
                ours, theirs = f"ours-{i}-{c}.bin", f"xfer/boto-{i}-{c}.bin"
                started = time.perf_counter()
                with storages[c].open_write(ours) as stream:
                    view = memoryview(data)
                    for offset in range(0, len(data), 64 * MiB):  # torch.save hands over large buffers like this
                        stream.write(view[offset:offset + 64 * MiB])
                runs[f"async_ckpt_upload_x{c}"].append(time.perf_counter() - started)
                started = time.perf_counter()
                client.upload_fileobj(io.BytesIO(data), bucket, theirs, Config=configs[c])
                runs[f"boto3_upload_x{c}"].append(time.perf_counter() - started)
                if download:
                    started = time.perf_counter()
                    storages[c].get_file(ours, os.path.join(tmp, "ours.bin"))
                    runs[f"async_ckpt_download_x{c}"].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    with open(os.path.join(tmp, "boto.bin"), "wb") as fh:
                        client.download_fileobj(bucket, theirs, fh, Config=configs[c])
                    runs[f"boto3_download_x{c}"].append(time.perf_counter() - started)
                    storages[c].delete(ours)
                    client.delete_object(Bucket=bucket, Key=theirs)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in runs.items()}
    result = {"bytes": nbytes, "part_size": part_size, "upload_threads": upload_threads, "repeats": repeats,
              "concurrency": list(concurrency), "seconds": runs, "median_gbps": gbps,
              "uploader_peak_buffered_bytes": max(s.stats.peak_buffered_bytes for s in storages.values())}
    for d in directions:
        ours, theirs = _best(gbps, f"async_ckpt_{d}", concurrency), _best(gbps, f"boto3_{d}", concurrency)
        result[f"async_ckpt_best_{d}_concurrency"], result[f"boto3_best_{d}_concurrency"] = ours, theirs
        result[f"{d}_ratio_vs_boto3"] = gbps[f"async_ckpt_{d}_x{ours}"] / gbps[f"boto3_{d}_x{theirs}"]
        if DEFAULT_CONCURRENCY in concurrency:
            result[f"{d}_ratio_vs_boto3_at_default"] = (gbps[f"async_ckpt_{d}_x{DEFAULT_CONCURRENCY}"]
                                                        / gbps[f"boto3_{d}_x{theirs}"])
    return result


@contextlib.contextmanager
def server_process(kind: str) -> Iterator[str]:
    """A moto (``moto-tls``: over https, self-signed) or null S3 server in its own process on
    127.0.0.1 (in-process, it would share the clients' GIL)."""
    from async_ckpt.launch import free_port

    port = free_port()
    endpoint = f"{'https' if kind == 'moto-tls' else 'http'}://127.0.0.1:{port}"
    module, probe = ("async_ckpt.bench.null_s3", "/") if kind == "null" else ("moto.server", "/moto-api/")
    args = {"moto": ["-H", "127.0.0.1", "-p", str(port)], "moto-tls": ["-H", "127.0.0.1", "-p", str(port), "-s"],
            "null": ["--port", str(port)]}[kind]
    server = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}{probe}", timeout=1, context=ssl._create_unverified_context()).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {kind} server on {endpoint} did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


def _report(result: dict, args: argparse.Namespace) -> str:
    g, cs = result["median_gbps"], result["concurrency"]
    lines = [f"{args.mib} MiB, parts of {args.part_mib} MiB, async_ckpt on {args.threads} upload thread(s), "
             f"median of {args.repeats}, server: {args.endpoint or args.server}"]
    for d in ("upload", "download"):
        if f"{d}_ratio_vs_boto3" not in result:
            continue
        ours, theirs = result[f"async_ckpt_best_{d}_concurrency"], result[f"boto3_best_{d}_concurrency"]
        lines.append(f"  {d:<8} async_ckpt (best: x{ours}) {g[f'async_ckpt_{d}_x{ours}']:.3f} GB/s   boto3 (best: "
                     f"x{theirs}) {g[f'boto3_{d}_x{theirs}']:.3f} GB/s   ratio {result[f'{d}_ratio_vs_boto3']:.2f}x"
                     + (f"   (async_ckpt at its default x{DEFAULT_CONCURRENCY}: "
                        f"{result[f'{d}_ratio_vs_boto3_at_default']:.2f}x)" if f"{d}_ratio_vs_boto3_at_default"
                        in result else ""))
        lines.append("           by concurrency (async_ckpt / boto3): " + ", ".join(
            f"x{c} {g[f'async_ckpt_{d}_x{c}']:.3f} / {g[f'boto3_{d}_x{c}']:.3f}" for c in cs))
    lines.append(f"  uploader peak buffered: {result['uploader_peak_buffered_bytes'] / MiB:.0f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY),
                        help="parts in flight to measure both clients at (default 4 8 16)")
    parser.add_argument("--threads", type=int, default=4, help="async_ckpt's upload_threads (default 4)")
    parser.add_argument("--server", choices=("moto", "moto-tls", "null"), default="moto",
                        help="the local server to start when no --endpoint is given (moto-tls: https)")
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of a local server")
    parser.add_argument("--bucket", default="xfer-bench")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.endpoint is None:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(key, "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    null = args.endpoint is None and args.server == "null"
    verify = not (args.endpoint is None and args.server == "moto-tls")  # its certificate is self-signed
    with contextlib.ExitStack() as stack:
        if not verify:
            import warnings

            warnings.filterwarnings("ignore", message="Unverified HTTPS request")  # urllib3's, for boto3
        endpoint = args.endpoint or stack.enter_context(server_process(args.server))
        if not null:
            import boto3

            client = boto3.client("s3", endpoint_url=endpoint, verify=verify)
            if args.bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
                client.create_bucket(Bucket=args.bucket)
        result = measure(endpoint, args.bucket, args.mib * MiB, args.repeats, args.part_mib * MiB, args.threads,
                         tuple(args.concurrency), download=not null, verify=verify)
    result["server"] = args.endpoint or args.server
    print(_report(result, args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
