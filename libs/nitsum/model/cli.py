"""`nitsum model ...`: model utilities."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nitsum model", description="model utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write the deterministic tiny Llama checkpoint (Hugging Face format)")
    tiny.add_argument("dir", help="output directory (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    if args.command == "make-tiny":
        from nitsum.model.tiny import make_tiny

        path = make_tiny(args.dir, seed=args.seed)
        print(f"wrote tiny Llama checkpoint to {path}")
        return 0
    parser.error(f"unknown command {args.command}")
    return 2
