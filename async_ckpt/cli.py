"""The ``async-ckpt`` command: demo, bench, and tools to inspect, verify and clean checkpoint roots.

Every command that reads a root takes any fsspec URL; ``--endpoint`` and ``--storage-options``
(JSON) reach S3-compatible stores. Data commands accept ``--json``. Exit code 0 means success,
1 a failed check, 2 bad input or an unreachable destination.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _storage(args: argparse.Namespace) -> Any:
    from async_ckpt.storage import open_storage

    from async_ckpt.errors import CheckpointNotFoundError

    options = json.loads(args.storage_options) if args.storage_options else {}
    if args.endpoint:
        options["endpoint_url"] = args.endpoint
    storage = open_storage(args.url, options if "://" in args.url else None)
    local = storage.local_dir()
    if local is not None and not os.path.isdir(local):
        raise CheckpointNotFoundError(f"no such folder: {local}")
    return storage


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=1, default=str) if args.json else text)


def _ls(args: argparse.Namespace) -> int:
    from async_ckpt.catalog import list_tags, read_latest

    storage = _storage(args)
    latest = read_latest(storage)
    rows = []
    for info in list_tags(storage):
        m = info.manifest
        rows.append({"tag": info.tag, "committed": info.committed, "latest": info.tag == latest,
                     "step": m.step if m else None, "bytes": m.total_bytes if m else None,
                     "world_size": m.world_size if m else None, "zero_stage": m.zero_stage if m else None,
                     "dtype": m.dtype if m else None,
                     "time": datetime.fromtimestamp(m.created_unix, timezone.utc).isoformat() if m else None})
    lines = [f"{'tag':<24} {'state':<11} {'step':>7} {'GB':>8} {'ranks':>5} {'zero':>4} {'dtype':<5} time (UTC)"]
    for r in rows:
        state = "committed" if r["committed"] else "incomplete"
        lines.append(f"{r['tag'] + (' *' if r['latest'] else ''):<24} {state:<11} {r['step'] if r['step'] is not None else '-':>7} "
                     f"{(r['bytes'] or 0) / 1e9:>8.3f} {r['world_size'] or '-':>5} {r['zero_stage'] if r['zero_stage'] is not None else '-':>4} "
                     f"{r['dtype'] or '-':<5} {(r['time'] or '-')[:19]}")
    lines.append(f"(* = latest: {latest})" if latest else "(no 'latest' file)")
    _emit(args, {"url": storage.url, "latest": latest, "tags": rows}, "\n".join(lines))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from async_ckpt.resume import resolve
    from async_ckpt.verify import verify_tag

    storage = _storage(args)
    manifest = resolve(storage, args.tag)
    checks = verify_tag(storage, manifest)
    bad = [c for c in checks if not c.ok]
    lines = [f"{'ok' if c.ok else 'BAD':<4} {c.path}" + (f"  ({c.problem})" if c.problem else "") for c in checks]
    lines.append(f"{manifest.tag}: {len(checks) - len(bad)}/{len(checks)} files match the manifest")
    _emit(args, {"url": storage.url, "tag": manifest.tag, "ok": not bad, "files": [asdict(c) for c in checks]},
          "\n".join(lines))
    return EXIT_FAILED if bad else EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    from async_ckpt.gc import collect_garbage

    report = collect_garbage(_storage(args), grace_s=args.grace_s, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    text = "\n".join([f"{verb} {len(report.incomplete_tags)} incomplete tag(s): {report.incomplete_tags}",
                      f"{verb} {len(report.partial_files)} partial file(s): {report.partial_files}",
                      f"{verb} {len(report.marker_dirs)} leftover commit-marker folder(s)",
                      f"{'would abort' if args.dry_run else 'aborted'} {len(report.aborted_uploads)} multipart "
                      f"upload(s): {report.aborted_uploads}"])
    _emit(args, asdict(report), text)
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from async_ckpt.demo import run_demo

    run_demo(args.dir, steps=args.steps, save_every=args.save_every, size=args.size)
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from benchmarks.save_bench import config_from_args, run

    run(config_from_args(args))
    return EXIT_OK


def _root_args(parser: argparse.ArgumentParser, json_flag: bool = True) -> None:
    parser.add_argument("url", help="checkpoint root: local path or fsspec URL (s3://bucket/run1)")
    parser.add_argument("--endpoint", help="S3 endpoint URL (S3-compatible stores, moto, MinIO)")
    parser.add_argument("--storage-options", help="fsspec storage options as JSON")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="async-ckpt", description="Non-blocking DeepSpeed checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT on 2 CPU ranks, save asynchronously, resume")
    demo.add_argument("--dir", default=None, help="checkpoint root (default: a new temporary folder)")
    demo.add_argument("--steps", type=int, default=20, help="training steps in phase 1 (default 20)")
    demo.add_argument("--save-every", type=int, default=5, help="steps between saves (default 5)")
    demo.add_argument("--size", choices=["tiny", "small", "bench"], default="small", help="model size")
    demo.set_defaults(func=_demo)
    ls = sub.add_parser("ls", help="list tags: committed or incomplete, step, size, ranks, ZeRO stage, time")
    _root_args(ls)
    ls.set_defaults(func=_ls)
    verify = sub.add_parser("verify", help="check every file's size and CRC-32 against the manifest")
    _root_args(verify)
    verify.add_argument("--tag", default=None, help="tag to verify (default: the newest committed)")
    verify.set_defaults(func=_verify)
    gc = sub.add_parser("gc", help="remove incomplete tags, partial files and orphaned multipart uploads")
    _root_args(gc)
    gc.add_argument("--grace-s", type=float, default=3600.0, help="leave anything younger alone (default 3600)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.set_defaults(func=_gc)
    try:
        from benchmarks.save_bench import add_arguments
    except ImportError:  # installed without the source tree's benchmarks package
        return parser
    bench = sub.add_parser("bench", help="save stall, time to durable and slowdown vs stock DeepSpeed, "
                                         "DCP async_save and the hardware floors")
    add_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from async_ckpt.errors import AsyncCkptError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (AsyncCkptError, json.JSONDecodeError, FileNotFoundError) as exc:
        print(f"async-ckpt {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
