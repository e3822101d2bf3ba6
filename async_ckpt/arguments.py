"""Argument types shared by the ``async-ckpt`` commands and the benchmarks: a bad number is refused by
argparse, naming the flag and the value (exit 2), before anything runs."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable

from async_ckpt.errors import UsageError


def bounded_number(kind: type, minimum: float, maximum: float = math.inf) -> Callable[[str], Any]:
    """An argparse ``type`` that parses ``kind`` and refuses values outside ``[minimum, maximum]``, naming them."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not (minimum <= value <= maximum and (kind is int or math.isfinite(value))):  # NaN fails too
            within = f"at least {minimum:g}" + (f" and at most {maximum:g}" if maximum < math.inf else " and finite")
            raise argparse.ArgumentTypeError(f"must be {within}, got {text!r}")
        return value
    return parse


COUNT, INDEX = bounded_number(int, 1), bounded_number(int, 0)
SECONDS = bounded_number(float, 0)
#: A shard of one byte at least, and of at most a petabyte (its size in bytes stays a finite integer).
GIGABYTES = bounded_number(float, 1e-9, 1e6)


def make_writable_folder(path: str, flag: str, fix: str) -> None:
    """Make the folder ``path`` that ``flag`` names, or refuse it (:class:`UsageError`, ending with ``fix``):
    a file there, a folder that cannot be made or written. Checked before a run starts, which would
    otherwise fail on one of its ranks, or at its end."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a file; {fix}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path} cannot be made ({exc.strerror}); {fix}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} is not writable; {fix}")
