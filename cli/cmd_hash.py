"""`kvindex hash`: vLLM block hashes for a token sequence, as JSON on stdout.

A thin shell over kvindex.hashing.BlockHasher: parses arguments, reads the token file and the
PYTHONHASHSEED default (the only place the environment is read), prints the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvindex.cli.main import CliError
from kvindex.hashing import BlockHasher, HashingError, MMItem, event_hash
from kvindex.hashing.algorithms import HASH_ALGOS


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--algo", default="sha256", help=f"hash algorithm: {', '.join(HASH_ALGOS)} (default sha256)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per hashed block (default 16)")
    parser.add_argument(
        "--seed",
        default=None,
        help="the engines' PYTHONHASHSEED (default: this process's PYTHONHASHSEED; unset -> vLLM's rule)",
    )
    parser.add_argument("--lora-name", help="LoRA adapter name (give --lora-path too: vLLM hashes both)")
    parser.add_argument("--lora-path", help="LoRA adapter path")
    parser.add_argument("--cache-salt", help="the request's cache_salt")
    parser.add_argument(
        "--mm",
        action="append",
        default=[],
        metavar="IDENTIFIER:OFFSET:LENGTH",
        help="a multimodal placeholder (repeatable, in prompt order)",
    )
    tokens = parser.add_mutually_exclusive_group(required=True)
    tokens.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    tokens.add_argument("--tokens-file", type=Path, help="a JSON file holding a list of token ids")


def parse_mm(spec: str) -> MMItem:
    """IDENTIFIER:OFFSET:LENGTH (the identifier may itself contain ':', e.g. a LoRA prefix)."""
    identifier, sep1, rest = spec.rpartition(":")
    identifier, sep2, offset = identifier.rpartition(":")
    if not (sep1 and sep2 and identifier):
        raise CliError(f"--mm {spec!r} must be IDENTIFIER:OFFSET:LENGTH")
    try:
        return MMItem(identifier=identifier, offset=int(offset), length=int(rest))
    except ValueError:
        raise CliError(f"--mm {spec!r}: OFFSET and LENGTH must be integers") from None


def _read_tokens(args: argparse.Namespace) -> list[Any]:
    # Any: a file's JSON values go to the hasher unchecked; BlockHasher rejects a non-integer with the
    # same HashingError sentence as any other bad token id.
    if args.tokens is not None:
        text = args.tokens.strip()
        if not text:
            return []
        try:
            return [int(part) for part in text.split(",")]
        except ValueError:
            raise CliError("--tokens must be comma-separated integers, e.g. 1,2,3") from None
    try:
        loaded = json.loads(args.tokens_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CliError(f"cannot read --tokens-file {str(args.tokens_file)!r}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise CliError(
            f"--tokens-file {str(args.tokens_file)!r} is not JSON; it must hold a list of token ids"
        ) from None
    if not isinstance(loaded, list):
        raise CliError(f"--tokens-file {str(args.tokens_file)!r} must hold a JSON list of token ids")
    return loaded


def run(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else os.environ.get("PYTHONHASHSEED")
    mm = [parse_mm(spec) for spec in args.mm]
    token_ids = _read_tokens(args)
    try:
        hasher = BlockHasher(algo=args.algo, block_size=args.block_size, seed=seed, memo_size=0)
        digests = hasher.block_hashes(
            token_ids,
            lora_name=args.lora_name,
            lora_path=args.lora_path,
            cache_salt=args.cache_salt,
            mm=mm or None,
        )
    except HashingError as exc:
        raise CliError(str(exc)) from None
    result = {
        "root_hex": hasher.root.hex(),
        "block_hashes_hex": [digest.hex() for digest in digests],
        "event_hashes": [event_hash(digest) for digest in digests],
    }
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0
