"""Retrying transient object-store failures: exponential backoff with full jitter, per request."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

logger = logging.getLogger("async_ckpt")

T = TypeVar("T")

_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                    "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "TooManyRequestsException",
                    "RequestThrottled", "503", "500", "502", "504", "429",
                    # a body the store received damaged (its checksum does not match): sent again from the same buffer
                    "BadDigest", "XAmzContentChecksumMismatch", "XAmzContentSHA256Mismatch"}
_PERMANENT_5XX = {501, 505}  # Not Implemented, HTTP Version Not Supported


def is_transient(exc: BaseException) -> bool:
    """HTTP 5xx and 429, throttling, timeouts, dropped connections and a body that arrived damaged are worth
    another try; other 4xx are not, nor 501 and 505: a store that does not implement a request (some
    S3-compatible stores answer checksum headers so) answers every retry alike."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = str(response.get("Error", {}).get("Code", ""))
        return (status >= 500 and status not in _PERMANENT_5XX) or status == 429 or code in _TRANSIENT_CODES
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return True
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    # aiohttp client errors and botocore's HTTP-level errors (EndpointConnectionError, ReadTimeoutError...)
    return module.startswith("aiohttp") or name.endswith(("ConnectionError", "TimeoutError", "ConnectionClosedError",
                                                          "IncompleteRead", "IncompleteReadError",
                                                          "ResponseStreamingError", "ClientPayloadError"))


#: The backoff's own random numbers: a retry in a background save must not draw from the process-wide
#: generator, whose sequence the training code's own ``random`` calls (and a bitwise resume) depend on.
_JITTER = random.Random()


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    base_delay_s: float = 0.2
    max_delay_s: float = 20.0

    def delay(self, attempt: int) -> float:
        return _JITTER.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** min(attempt, 64)))  # no overflow

    async def run(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Await ``call()``, retrying transient failures; the last error propagates."""
        for attempt in range(self.attempts):
            try:
                return await call()
            except Exception as exc:
                if attempt + 1 >= self.attempts or not is_transient(exc):
                    raise
                pause = self.delay(attempt)
                logger.debug("%s: transient %s (%s), retry %d/%d in %.2f s", what, type(exc).__name__, exc,
                             attempt + 1, self.attempts - 1, pause)
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")
