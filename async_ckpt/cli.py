"""The ``async-ckpt`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from async_ckpt.demo import run_demo

    run_demo(args.dir, steps=args.steps, save_every=args.save_every, size=args.size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="async-ckpt", description="Non-blocking DeepSpeed checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT on 2 CPU ranks, save asynchronously, resume")
    demo.add_argument("--dir", default=None, help="checkpoint root (default: a new temporary folder)")
    demo.add_argument("--steps", type=int, default=20, help="training steps in phase 1 (default 20)")
    demo.add_argument("--save-every", type=int, default=5, help="steps between saves (default 5)")
    demo.add_argument("--size", choices=["tiny", "small", "bench"], default="small", help="model size")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
