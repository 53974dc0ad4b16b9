"""The hash-settings flags `kvindex serve` and `kvindex sidecar` share (read back by cli/config.py's
ModelFlags). Kept apart from config.py so building the parser imports nothing heavy."""

from __future__ import annotations

import argparse

from kvindex.hashing.algorithms import HASH_ALGOS


def add_hash_flags(parser: argparse.ArgumentParser, *, whose: str) -> None:
    """--block-size, --hash-algo and --hash-seed; `whose` names the engine(s) the seed must match."""
    parser.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block (default 16)")
    parser.add_argument(
        "--hash-algo", choices=HASH_ALGOS, help="vLLM's --prefix-caching-hash-algo (default sha256)"
    )
    parser.add_argument(
        "--hash-seed",
        metavar="SEED",
        help=f"{whose} PYTHONHASHSEED (default: this process's PYTHONHASHSEED; unset -> vLLM's rule)",
    )
