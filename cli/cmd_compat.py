"""`kvindex compat vectors PATH`: prove our hashes match the vLLM release that wrote a vectors file.

Shell over kvindex.hashing.compat: reads the file, prints a summary (or JSON), exit 0 only if every case
agrees; a malformed file is a CliError (exit 2, one sentence).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvindex.cli.main import CliError

if TYPE_CHECKING:  # imported in run(): only this subcommand needs the harness
    from kvindex.hashing.compat import CompatReport


def configure(parser: argparse.ArgumentParser) -> None:
    checks = parser.add_subparsers(dest="check", metavar="CHECK", required=True)
    vectors = checks.add_parser(
        "vectors",
        help="recompute every case of a kvindex-hash-vectors/1 file",
        description="Recompute every case of a kvindex-hash-vectors/1 file (root, block hashes, event hashes, "
        "event extra keys); exit 0 only if all agree.",
    )
    vectors.add_argument("path", type=Path, help="the vectors file, e.g. tests/vectors/hash-vectors.json")
    vectors.add_argument("--json", action="store_true", help="print the report as JSON")


def _print_summary(report: CompatReport) -> None:
    for failure in report.failed:
        print(f"FAIL {failure.id}: first bad block {failure.first_bad_block}")
    for skip in report.skipped:
        print(f"SKIP {skip.id}: {skip.reason}")
    print(f"{report.passed} passed, {len(report.failed)} failed, {len(report.skipped)} skipped")


def run(args: argparse.Namespace) -> int:
    import msgspec
    from kvindex.hashing.compat import VectorsFileError, check_vectors

    try:
        data = args.path.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read vectors file {str(args.path)!r}: {exc.strerror}") from None
    try:
        report = check_vectors(data)
    except VectorsFileError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        _print_summary(report)
    return 0 if not report.failed and report.passed == report.total else 1
