"""A real S3 HTTP API on 127.0.0.1 for the tests: moto's server mode, and a fault-injecting proxy.

``ASYNC_CKPT_TEST_S3_ENDPOINT`` runs the same tests against any other S3 endpoint instead
(credentials from the usual AWS environment variables; buckets are created by the tests).
"""

from __future__ import annotations

import http.client
import os
import re
import threading
import time
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from async_ckpt.launch import free_port

DUMMY_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """Starts moto on a free loopback port (or uses the external endpoint), resets it on demand."""

    def __init__(self) -> None:
        self.external = os.environ.get("ASYNC_CKPT_TEST_S3_ENDPOINT")
        self._moto = None
        self._created: list[str] = []
        if self.external:
            self.endpoint = self.external.rstrip("/")
            self.env = {k: os.environ[k] for k in DUMMY_ENV if k in os.environ}
        else:
            from moto.server import ThreadedMotoServer

            port = free_port()
            self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            self._moto.start()
            self.endpoint = f"http://127.0.0.1:{port}"
            self.env = dict(DUMMY_ENV)

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.env.get("AWS_ACCESS_KEY_ID"),
                            aws_secret_access_key=self.env.get("AWS_SECRET_ACCESS_KEY"))

    def reset(self) -> None:
        if self._moto is not None:
            urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")).read()

    def make_bucket(self, name: str) -> str:
        """Create a bucket; against an external endpoint its name gets a unique suffix (runs repeat there)."""
        if self.external:
            name = f"{name[:40]}-{uuid.uuid4().hex[:12]}"
            self._created.append(name)
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self._moto is not None:
            self._moto.stop()
        for bucket in self._created:  # an external endpoint keeps what a run made: remove it
            self._empty_and_delete(bucket)

    def _empty_and_delete(self, bucket: str) -> None:
        client = self.client()
        for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        client.delete_bucket(Bucket=bucket)


class FaultProxy:
    """An HTTP proxy in front of the S3 endpoint that makes UploadPart requests fail.

    The fault ``kind`` is ``"503"`` (a SlowDown answer), ``"429"`` (TooManyRequests), ``"reset"`` (the connection is closed
    without an answer) or ``"stall"`` (no answer for ``stall_s`` seconds, then the connection is
    closed: a client read timeout shorter than that sees a timeout) or ``"unread"`` (the body of a part, or of a
    whole object's PUT, is left unread, with no answer, until ``heal()``: a store that stops reading mid-body). ``fail_next_parts(n)`` fails
    the next n part uploads (transient); ``fail_all_parts()`` fails every one (permanent);
    ``heal()`` stops injecting. Other processes (the ranks) do the same with
    ``POST {endpoint}/__faults__?parts=N`` (see :func:`set_faults`). ``hold`` (or
    ``?hold=TEXT``, :func:`set_hold`) makes PUTs (parts or whole objects) whose path contains TEXT
    hang until ``heal()``: a write that stays in flight, for kill tests; ``held`` counts those
    hanging now (:func:`held_requests`). ``refuse_deletes`` answers every DeleteObjects request with
    an AccessDenied error per key, and deletes nothing, as S3 does for keys a policy protects.
    ``no_list_permission`` answers 403 AccessDenied where the store answers a GET or HEAD with 404, as S3
    does for a missing key when the credentials lack s3:ListBucket. ``deny_list_parts`` answers every
    ListParts request with 403 AccessDenied, as S3 does without s3:ListMultipartUploadParts, and
    ``deny_aborts`` every AbortMultipartUpload likewise. Everything
    else passes through unchanged. ``fail_next_listings(n)`` answers the next n object listings with
    500 InternalError. ``lose_next_completion(relay)`` closes the connection of the next
    CompleteMultipartUpload without an answer, after relaying it if ``relay``, and answers every later
    completion of that upload 404 NoSuchUpload, as MinIO and Ceph do once an upload completed.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self._lock = threading.Lock()
        self._budget = 0
        self.kind = "503"
        self.stall_s = 3.0
        self.hold = ""
        self.held = 0
        self.injected = 0
        self.refuse_deletes = False
        self.no_list_permission = False
        self.deny_list_parts = False
        self.deny_aborts = False
        self._listing_faults = 0
        self._completion_fault: bool | None = None  # None: none; else whether the lost completion is relayed
        self._forgotten_uploads: set[str] = set()
        self._healed = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer_xml(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _upstream(self, body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
                """Send this request on to the store: its answer and body."""
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "transfer-encoding")}
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    return resp, resp.read()
                finally:
                    conn.close()

            def _relay(self):
                query = parse_qs(urlsplit(self.path).query)
                if self.command == "PUT" and proxy.kind == "unread" and proxy._take_fault():
                    proxy._healed.wait()
                    self.close_connection = True
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.path.startswith("/__faults__"):  # control: parts=N fails the next N, -1 all, 0 heals
                    with proxy._lock:
                        if "parts" in query:
                            proxy._budget = int(query["parts"][0])
                        proxy.hold = query.get("hold", [proxy.hold])[0]
                        count = str(proxy.held if "held" in query else proxy.injected).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(count)))
                    self.end_headers()
                    self.wfile.write(count)  # faults injected so far
                    return
                if self.command == "PUT" and proxy.hold and proxy.hold in self.path:
                    with proxy._lock:
                        proxy.held += 1
                    while proxy.hold and proxy.hold in self.path:
                        time.sleep(0.05)
                    with proxy._lock:
                        proxy.held -= 1
                    self.close_connection = True
                    return
                deleting = "delete" in urlsplit(self.path).query.replace("=", "&").split("&")
                if self.command == "POST" and deleting and proxy.refuse_deletes:
                    keys = re.findall(rb"<Key>(.*?)</Key>", body)
                    payload = (b"<?xml version='1.0' encoding='UTF-8'?><DeleteResult>" + b"".join(
                        b"<Error><Key>" + key + b"</Key><Code>AccessDenied</Code><Message>Access Denied</Message>"
                        b"</Error>" for key in keys) + b"</DeleteResult>")
                    self._answer_xml(200, payload)
                    return
                if self.command == "GET" and "list-type" in query and proxy._take_listing_fault():
                    self._answer_xml(500, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                                          b"<Message>We encountered an internal error.</Message></Error>")
                    return
                if "uploadId" in query and (self.command, True) in (("GET", proxy.deny_list_parts),
                                                                    ("DELETE", proxy.deny_aborts)):
                    self._answer_xml(403, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                                          b"<Message>Access Denied</Message></Error>")
                    return
                if self.command == "POST" and "uploadId" in query:
                    upload = query["uploadId"][0]
                    if upload in proxy._forgotten_uploads:
                        self._answer_xml(404, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchUpload</Code>"
                                              b"<Message>The specified upload does not exist.</Message></Error>")
                        return
                    relay = proxy._take_completion_fault(upload)
                    if relay is not None:
                        if relay:
                            self._upstream(body)
                        self.close_connection = True
                        return
                if self.command == "PUT" and "partNumber" in query and proxy._take_fault():
                    if proxy.kind in ("reset", "stall"):
                        if proxy.kind == "stall":
                            time.sleep(proxy.stall_s)
                        self.close_connection = True  # no answer: the client sees a dropped connection
                        return
                    if proxy.kind == "429":
                        self._answer_xml(429, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>TooManyRequests"
                                              b"</Code><Message>Too many requests.</Message></Error>")
                        return
                    payload = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                               b"<Message>Please reduce your request rate.</Message></Error>")
                    self._answer_xml(503, payload)
                    return
                resp, data = self._upstream(body)
                if resp.status == 404 and self.command in ("GET", "HEAD") and proxy.no_list_permission:
                    self._answer_xml(403, b"" if self.command == "HEAD" else
                                     b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                                     b"<Message>Access Denied</Message></Error>")
                    return
                self.send_response(resp.status, resp.reason)
                for key, value in resp.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    def _take_fault(self) -> bool:
        with self._lock:
            if self._budget != 0:
                self._budget -= 1 if self._budget > 0 else 0
                self.injected += 1
                return True
            return False

    def _take_listing_fault(self) -> bool:
        with self._lock:
            if self._listing_faults > 0:
                self._listing_faults -= 1
                self.injected += 1
                return True
            return False

    def _take_completion_fault(self, upload: str) -> bool | None:
        with self._lock:
            relay, self._completion_fault = self._completion_fault, None
            if relay is not None:
                self._forgotten_uploads.add(upload)
                self.injected += 1
            return relay

    def lose_next_completion(self, relay: bool) -> None:
        with self._lock:
            self._completion_fault = relay

    def fail_next_listings(self, n: int) -> None:
        with self._lock:
            self._listing_faults = n

    def fail_next_parts(self, n: int, kind: str = "503") -> None:
        with self._lock:
            self._budget = n
            self.kind = kind
            self._healed.clear()

    def fail_all_parts(self, kind: str = "503") -> None:
        with self._lock:
            self._budget = -1
            self.kind = kind
            self._healed.clear()

    def heal(self) -> None:
        with self._lock:
            self._budget = 0
            self.hold = ""
            self._healed.set()

    def stop(self) -> None:
        self.heal()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def options(endpoint: str, **extra) -> dict:
    """storage_options for an S3 endpoint (credentials come from the environment)."""
    return {"endpoint_url": endpoint, **extra}


def set_faults(proxy_endpoint: str, parts: int) -> int:
    """From any process: fail the next ``parts`` part uploads (-1: all, 0: none); returns the faults injected so far."""
    req = urllib.request.Request(f"{proxy_endpoint}/__faults__?parts={parts}", method="POST")
    return int(urllib.request.urlopen(req).read() or 0)


def held_requests(proxy_endpoint: str) -> int:
    """From any process: how many PUTs the proxy holds right now."""
    return int(urllib.request.urlopen(f"{proxy_endpoint}/__faults__?held=1").read() or 0)


def set_hold(proxy_endpoint: str, match: str) -> None:
    """From any process: hang part uploads whose path contains ``match`` ('' releases them)."""
    req = urllib.request.Request(f"{proxy_endpoint}/__faults__?hold={urllib.parse.quote(match)}", method="POST")
    urllib.request.urlopen(req).read()
