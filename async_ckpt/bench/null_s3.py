"""A null S3 endpoint: it answers the calls of a multipart upload, reads every body and keeps nothing.

With moto, the server's own CPU (pure Python, on the same cores) hides what the clients cost.
Against this endpoint the client is the bottleneck, so ``s3_transfer --server null`` measures each
client's ceiling: what its signing, checksums and copies allow per byte. Uploads only (nothing
is stored to download).

    python -m async_ckpt.bench.null_s3 --port 9000
"""

from __future__ import annotations

import argparse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_CHUNK = 1 << 20


class NullS3Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _drain(self) -> None:
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining:
            chunk = self.rfile.read(min(remaining, _CHUNK))
            if not chunk:
                break
            remaining -= len(chunk)

    def _answer(self, body: bytes = b"", headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.send_response(200)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:  # PutObject, UploadPart: echo the client's checksum as S3 does
        self._drain()
        headers = [("ETag", f'"{uuid.uuid4().hex}"')]
        headers += [(k, v) for k, v in self.headers.items() if k.lower().startswith("x-amz-checksum-")]
        self._answer(headers=tuple(headers))

    def do_POST(self) -> None:  # CreateMultipartUpload, CompleteMultipartUpload
        self._drain()
        xml = ("<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><UploadId>null</UploadId>"
               "</InitiateMultipartUploadResult>") if "uploads" in parse_qs(urlsplit(self.path).query,
                                                                             keep_blank_values=True) else (
            '<CompleteMultipartUploadResult><Bucket>b</Bucket><Key>k</Key><ETag>"null"</ETag>'
            "</CompleteMultipartUploadResult>")
        self._answer(f'<?xml version="1.0" encoding="UTF-8"?>{xml}'.encode(), (("Content-Type", "application/xml"),))

    def do_GET(self) -> None:  # readiness probe
        self._answer(b"null s3")

    do_DELETE = do_HEAD = _answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), NullS3Handler)
    server.daemon_threads = True
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
