"""The ``async-ckpt`` command: demo, bench, and tools to inspect, verify, clean, pull, export and convert.

Every command that reads a root takes any fsspec URL; ``--endpoint`` and ``--storage-options``
(JSON) reach S3-compatible stores. Data commands accept ``--json``. Exit code 0 means success,
1 a failed check or a demo or bench run that failed on one of its ranks, 2 bad input, a tag this
version cannot read (another version's manifest format) or an unreachable destination.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

from async_ckpt.arguments import COUNT, GIGABYTES, INDEX, SECONDS

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _storage(args: argparse.Namespace, *, options_elsewhere: bool = False) -> Any:
    """The storage of the checkpoint root ``args.url``. ``--storage-options``/``--endpoint`` are for an
    object store: refused with a local root, unless ``options_elsewhere`` (another URL of the command takes them)."""
    from async_ckpt.config import local_path
    from async_ckpt.errors import CheckpointNotFoundError, UsageError
    from async_ckpt.storage import open_storage

    if not args.url.strip():
        raise UsageError("the checkpoint URL is empty; pass the root folder or URL the checkpoints were saved to")
    if local_path(args.url) == "":
        raise UsageError(f"the checkpoint URL {args.url!r} names no folder; pass the root folder or URL the "
                         "checkpoints were saved to")
    options = _source_options(args)
    if options and local_path(args.url) is not None:
        if not options_elsewhere:
            raise UsageError(f"--storage-options and --endpoint are for an object store, but {args.url} is a local "
                             "path: drop them, or write the URL with its scheme (s3://bucket/run)")
        options = {}
    storage = open_storage(args.url, options)
    local = storage.local_dir()
    if local is not None and not os.path.isdir(local):
        raise CheckpointNotFoundError(f"no such folder: {local}")
    return storage


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=1, default=str) if args.json else text)


def _ls(args: argparse.Namespace) -> int:
    from async_ckpt.catalog import inspect_latest, list_tags

    storage = _storage(args)
    latest, latest_error = inspect_latest(storage)
    rows = []
    for info in list_tags(storage):
        m = info.manifest
        rows.append({"tag": info.tag, "state": info.state, "committed": info.committed, "error": info.error,
                     "latest": info.tag == latest,
                     "step": m.step if m else None, "bytes": m.total_bytes if m else None,
                     "world_size": m.world_size if m else None, "zero_stage": m.zero_stage if m else None,
                     "dtype": m.dtype if m else None,
                     "time": datetime.fromtimestamp(m.created_unix, timezone.utc).isoformat() if m else None})
    lines = [f"{'tag':<24} {'state':<11} {'step':>7} {'GB':>8} {'ranks':>5} {'zero':>4} {'dtype':<5} time (UTC)"]
    for r in rows:
        state = r["state"]
        lines.append(f"{r['tag'] + (' *' if r['latest'] else ''):<24} {state:<11} {r['step'] if r['step'] is not None else '-':>7} "
                     f"{(r['bytes'] or 0) / 1e9:>8.3f} {r['world_size'] or '-':>5} {r['zero_stage'] if r['zero_stage'] is not None else '-':>4} "
                     f"{r['dtype'] or '-':<5} {(r['time'] or '-')[:19]}")
    lines += [f"{r['tag']}: {r['state']}: {r['error']}" for r in rows if r["error"]]
    if not rows and not storage.list_dir(""):
        lines.append(f"(nothing is stored under {storage.url}: check the URL)")
    lines.append(f"(* = latest: {latest})" if latest else f"('latest' cannot be read: {latest_error})"
                 if latest_error else "(no 'latest' file)")
    _emit(args, {"url": storage.url, "latest": latest, "latest_error": latest_error, "tags": rows},
          "\n".join(lines))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from async_ckpt.errors import CorruptManifestError, UnsupportedManifestError
    from async_ckpt.resume import resolve
    from async_ckpt.verify import on_other_nodes, unlisted_shards, verify_tag

    storage = _storage(args)
    try:
        manifest = resolve(storage, args.tag)
    except (CorruptManifestError, UnsupportedManifestError) as exc:  # a tag this version cannot check: exit 2
        corrupt = isinstance(exc, CorruptManifestError)
        _emit(args, {"url": storage.url, "tag": args.tag, "ok": False, "error": str(exc)},
              f"{'BAD' if corrupt else 'UNSUPPORTED'}  {exc}")
        return EXIT_FAILED if corrupt else EXIT_BAD_INPUT
    checks = on_other_nodes(manifest, verify_tag(storage, manifest))
    unlisted = unlisted_shards(storage, manifest)
    bad = [c for c in checks if not c.ok and not c.elsewhere]
    elsewhere = [c for c in checks if c.elsewhere]
    lines = [(f"--   {c.path}  (another node's: not in this node folder)" if c.elsewhere else
              f"{'ok' if c.ok else 'BAD':<4} {c.path}" + (f"  ({c.problem})" if c.problem else ""))
             for c in checks + unlisted]
    lines.append(f"{manifest.tag}: {len(checks) - len(bad) - len(elsewhere)}/{len(checks) - len(elsewhere)} files "
                 "match the manifest" + (f"; {len(elsewhere)} are other nodes'" if elsewhere else "")
                 + (f"; {len(unlisted)} shard(s) in its folder it does not list" if unlisted else ""))
    _emit(args, {"url": storage.url, "tag": manifest.tag, "ok": not bad and not unlisted,
                 "files": [asdict(c) for c in checks], "unlisted": [asdict(c) for c in unlisted]}, "\n".join(lines))
    return EXIT_FAILED if bad or unlisted else EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    from async_ckpt.gc import collect_garbage

    report = collect_garbage(_storage(args), grace_s=args.grace_s, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    text = "\n".join([f"{verb} {len(report.incomplete_tags)} incomplete tag(s): {report.incomplete_tags}",
                      f"{verb} {len(report.corrupt_tags)} corrupt tag(s): {report.corrupt_tags}",
                      f"{verb} {len(report.partial_files)} partial file(s): {report.partial_files}",
                      f"{verb} {len(report.bookkeeping)} bookkeeping leftover(s): {report.bookkeeping}",
                      f"{'would abort' if args.dry_run else 'aborted'} {len(report.aborted_uploads)} multipart "
                      f"upload(s): {report.aborted_uploads}"]
                     + [f"kept {tag}: not committed, but latest names it (or cannot be read)"
                        for tag in report.kept_latest]
                     + [f"kept {tag}: neither a manifest nor a start mark (not a save async_ckpt started)"
                        for tag in report.kept_foreign]
                     + [f"kept {tag}: its manifest is in another async_ckpt version's format"
                        for tag in report.kept_unsupported]
                     + [f"kept upload {key}: outside async_ckpt's tag folders" for key in report.kept_uploads])
    _emit(args, asdict(report), text)
    return EXIT_OK


def _local_folder(value: str, flag: str) -> str:
    """The local folder an output flag names (``file://`` stripped); :class:`UsageError` for another URL,
    which a plain path would otherwise become: a folder named ``s3:`` here, the command reporting success."""
    from async_ckpt.config import local_path
    from async_ckpt.errors import UsageError

    path = local_path(value)
    if path is None:
        raise UsageError(f"{flag} {value} is a URL; {flag} takes a local folder. Write there, then copy it to the "
                         "object store (e.g. `aws s3 sync`)")
    return path


def _pull(args: argparse.Namespace) -> int:
    from async_ckpt.pull import pull
    from async_ckpt.resume import resolve

    dest = _local_folder(args.dest, "--dest")
    storage = _storage(args)
    report = pull(storage, resolve(storage, args.tag), dest, rank=args.rank,
                  max_concurrency=args.concurrency, show_progress=not args.json and not args.quiet)
    _emit(args, asdict(report), f"pulled {report.tag} into {report.dest}: {report.files_fetched} file(s) "
                                f"({report.bytes_fetched / 1e9:.3f} GB) fetched, {report.files_skipped} already "
                                f"there, in {report.seconds:.1f} s; verified against the manifest")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from async_ckpt.export import export_hf
    from async_ckpt.resume import resolve

    out = _local_folder(args.out, "--out")
    storage = _storage(args)
    report = export_hf(storage, resolve(storage, args.tag), out, dtype=args.dtype,
                       safetensors=args.safetensors, max_shard_bytes=int(args.max_shard_gb * 1e9),
                       show_progress=not args.json)
    _emit(args, asdict(report), f"exported {report.tag} to {report.out_dir}: {report.tensors} tensors, "
                                f"{report.total_bytes / 1e9:.3f} GB {report.dtype} in {len(report.shards)} shard(s)"
                                + (f"; also {', '.join(report.extra_files)}" if report.extra_files else
                                   "; no tokenizer or config.json in the checkpoint"))
    return EXIT_OK


def _to_universal(args: argparse.Namespace) -> int:
    from async_ckpt.config import local_path
    from async_ckpt.resume import resolve
    from async_ckpt.storage import open_storage
    from async_ckpt.universal import to_universal

    if args.out_storage_options:
        options = _json_object(args.out_storage_options, "--out-storage-options")
    else:  # the source's, where --out is a URL too
        options = {} if local_path(args.out) is not None else _source_options(args)
    # a local source with --out in an object store: --endpoint and --storage-options are for --out
    source = _storage(args, options_elsewhere=not args.out_storage_options and local_path(args.out) is None)
    with contextlib.closing(open_storage(args.out, options)) as dest:
        report = to_universal(source, resolve(source, args.tag), dest, tag=args.out_tag, workers=args.workers,
                              show_progress=not args.json)
    _emit(args, asdict(report), f"converted {report.source_tag} to universal tag {report.tag} at {report.url}: "
                                f"{report.files} files, {report.total_bytes / 1e9:.3f} GB in {report.seconds:.1f} s. "
                                "Load it with checkpoint.load_universal on any number of ranks")
    return EXIT_OK


def _source_options(args: argparse.Namespace) -> dict[str, Any]:
    """The storage options given for the source URL (``--storage-options``, ``--endpoint``)."""
    options = _json_object(args.storage_options, "--storage-options") if args.storage_options else {}
    if args.endpoint:
        options["endpoint_url"] = args.endpoint
    return options


def _json_object(text: str, flag: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object (fsspec's keyword arguments); :class:`UsageError` naming ``flag``
    for anything else (a list, a number)."""
    from async_ckpt.errors import UsageError

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} is not valid JSON ({exc}); write a JSON object such as '{{\"anon\": true}}', "
                         "in single quotes in the shell") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object of fsspec options, such as '{{\"anon\": true}}', "
                         f"got {type(value).__name__}: {text}")
    return value


def _require_extra(extra: str, modules: tuple[str, ...]) -> None:
    """Refuse a command whose optional packages are missing, naming the install that adds them."""
    from async_ckpt.errors import UsageError

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"this command needs packages that are not installed ({', '.join(missing)}): "
                         f"pip install 'async_ckpt[{extra}]'")


def _demo(args: argparse.Namespace) -> int:
    _require_extra("example", ("transformers", "tokenizers"))
    from async_ckpt.demo import run_demo

    figures = run_demo(None if args.dir is None else _local_folder(args.dir, "--dir"), steps=args.steps,
                       save_every=args.save_every, size=args.size)
    return EXIT_FAILED if any(save["durable_s"] is None for save in figures["train"]["saves"]) else EXIT_OK


def _bench_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """The optional packages a bench run needs: boto3 for the S3 floor wherever it targets S3 (``--url``
    alone makes a run do so) and moto for the embedded server where no ``--url`` is given."""
    s3 = args.target != "local" or bool(args.url)
    s3_modules = (("boto3",) + (() if args.url else ("moto",))) if s3 else ()
    return ("transformers", "tokenizers", "psutil", "matplotlib", *s3_modules)


def _bench(args: argparse.Namespace) -> int:
    _require_extra("bench", _bench_modules(args))
    from async_ckpt.bench.save_bench import config_from_args, run

    run(config_from_args(args))
    return EXIT_OK


def _root_args(parser: argparse.ArgumentParser, json_flag: bool = True, tag_verb: str | None = None) -> None:
    parser.add_argument("url", help="checkpoint root: local path or fsspec URL (s3://bucket/run1)")
    if tag_verb:
        parser.add_argument("--tag", default=None, help=f"tag to {tag_verb} (default: the newest committed)")
    parser.add_argument("--endpoint", help="S3 endpoint URL (S3-compatible stores, moto, MinIO)")
    parser.add_argument("--storage-options", help="fsspec storage options as JSON")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def build_parser() -> argparse.ArgumentParser:
    from async_ckpt.bench.save_bench import add_arguments as bench_arguments

    parser = argparse.ArgumentParser(prog="async-ckpt", description="Non-blocking DeepSpeed checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT on 2 CPU ranks, save asynchronously, resume")
    demo.add_argument("--dir", default=None, help="checkpoint root (default: a new temporary folder)")
    demo.add_argument("--steps", type=COUNT, default=20, help="training steps in phase 1 (default 20)")
    demo.add_argument("--save-every", type=COUNT, default=5, help="steps between saves (default 5)")
    demo.add_argument("--size", choices=["tiny", "small", "bench"], default="small", help="model size")
    demo.set_defaults(func=_demo)
    ls = sub.add_parser("ls", help="list tags: committed or incomplete, step, size, ranks, ZeRO stage, time")
    _root_args(ls)
    ls.set_defaults(func=_ls)
    verify = sub.add_parser("verify", help="check every file's size and CRC-32 against the manifest")
    _root_args(verify, tag_verb="verify")
    verify.set_defaults(func=_verify)
    gc = sub.add_parser("gc", help="remove incomplete tags, partial files and orphaned multipart uploads")
    _root_args(gc)
    gc.add_argument("--grace-s", type=SECONDS, default=3600.0,
                    help="leave anything younger alone (default 3600)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.set_defaults(func=_gc)
    pull = sub.add_parser("pull", help="download a committed tag into a local DeepSpeed checkpoint folder "
                                       "(parallel, resumable, verified)")
    _root_args(pull, tag_verb="pull")
    pull.add_argument("--dest", required=True, help="local folder; becomes a checkpoint root with 'latest'")
    pull.add_argument("--rank", type=INDEX, default=None, help="only the files this data-parallel rank loads")
    pull.add_argument("--concurrency", type=COUNT, default=8, help="files fetched at once (default 8)")
    pull.add_argument("--quiet", action="store_true", help="no progress bar")
    pull.set_defaults(func=_pull)
    export = sub.add_parser("export", help="consolidate a tag (DeepSpeed's zero_to_fp32) into a Hugging Face "
                                           "model folder: weight shards + index, tokenizer, config")
    _root_args(export, tag_verb="export")
    export.add_argument("--out", required=True, help="new or empty local folder")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights dtype (default fp32)")
    export.add_argument("--safetensors", action=argparse.BooleanOptionalAction, default=True,
                        help="safetensors shards (default) or, with --no-safetensors, pytorch_model .bin shards")
    export.add_argument("--max-shard-gb", type=GIGABYTES, default=5.0, help="largest shard in GB (default 5)")
    export.set_defaults(func=_export)
    universal = sub.add_parser("to-universal", help="convert a tag with DeepSpeed's ds_to_universal so it loads "
                                                    "on any number of ranks (checkpoint.load_universal)")
    _root_args(universal, tag_verb="convert")
    universal.add_argument("--out", required=True, help="destination root (local path or fsspec URL; may equal URL)")
    universal.add_argument("--out-tag", default=None, help="name of the converted tag (default: <tag>_universal)")
    universal.add_argument("--out-storage-options", default=None,
                           help="fsspec options for --out as JSON (default: the source's options)")
    universal.add_argument("--workers", type=COUNT, default=2, help="ds_to_universal worker processes (default 2)")
    universal.set_defaults(func=_to_universal)
    bench = sub.add_parser("bench", help="save stall, time to durable and slowdown vs stock DeepSpeed, "
                                         "DCP async_save and the hardware floors")
    bench_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def _unreachable(exc: BaseException) -> bool:
    """An error of the storage client itself: wrong bucket, endpoint, credentials, network."""
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore")


def main(argv: list[str] | None = None) -> int:
    from async_ckpt.errors import AsyncCkptError
    from async_ckpt.launch import RankError

    args = build_parser().parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to the stdout it finds at import; ours is data
        import deepspeed  # noqa: F401
    try:
        return args.func(args)
    except RankError as exc:  # a run that failed: the demo's and bench's input is checked before their ranks start
        print(f"async-ckpt {args.command}: failed on a rank: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (AsyncCkptError, json.JSONDecodeError, FileNotFoundError) as exc:  # JSON: a corrupt file read
        print(f"async-ckpt {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            print(f"async-ckpt {args.command}: {exc}. Free space on that device; export and to-universal also "
                  "stage the tag (a remote one in full, and "
                  f"to-universal its output) under the temporary folder {tempfile.gettempdir()}: point TMPDIR at a "
                  "larger disk", file=sys.stderr)
            return EXIT_BAD_INPUT
        if not _unreachable(exc):
            raise
        if getattr(args, "url", None) is None:  # demo, bench on local disk: no URL, endpoint or credentials
            print(f"async-ckpt {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        output = getattr(args, "dest", None) or getattr(args, "out", None)
        where = args.url + (f" or write to {output}" if output else "")  # every command left names a URL
        print(f"async-ckpt {args.command}: cannot read {where}: {type(exc).__name__}: {str(exc).rstrip('.')}. "
              f"Check the URL{', the output path' if output else ''}, --endpoint and the credentials", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
