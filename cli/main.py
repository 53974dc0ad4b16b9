"""The `kvindex` command line: one dispatcher, one module per subcommand.

Each subcommand module (cli/cmd_<name>.py) exposes `configure(parser)` and `run(args) -> int`.
Building the parser imports every cmd module, so a cmd module imports only light things at module level
(argparse, kvindex.hashing, whose CBOR table is built only when a *_cbor hasher is made) and its heavy
dependencies (aiohttp, ZMQ, prometheus_client, the indexer) inside `run()`: `kvindex hash` and
`kvindex --help` never pay for the service stack (tests check this).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvindex.cli.cmd_serve", "the indexer service"),
    "sim": (
        "kvindex.cli.cmd_sim",
        "simulated vLLM engines publishing real KV-event streams (PUB + ROUTER replay)",
    ),
    "sidecar": (
        "kvindex.cli.cmd_sidecar",
        "beside an engine: its KV events under the sidecar's own seq, plus snapshots of the pod's blocks",
    ),
    "demo": ("kvindex.cli.cmd_demo", "one command: simulated fleet + indexer + shared-prefix workload"),
    "hash": ("kvindex.cli.cmd_hash", "vLLM block hashes for a token sequence"),
    "compat": ("kvindex.cli.cmd_compat", "hash-compatibility harness"),
}


class Subcommand(Protocol):
    """What a cli/cmd_<name>.py module provides."""

    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class CliError(Exception):
    """A usage or input problem: printed as one sentence on stderr, exit code 2."""


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a flag it does not know is reported with the subcommand's own usage.

    argparse hands whatever a subcommand's parser leaves over back to the top-level parser, which then
    prints `usage: kvindex [-h] COMMAND ...`, naming none of the command's flags. A subcommand's parser
    gets every argument after the command's name, so anything it leaves over is a mistake in it.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")  # exits 2 with this usage
        return parsed, extras


def version() -> str:
    """The installed distribution's version (pyproject takes it from kvindex.__version__, the one place
    it is written; read from the metadata because cli/ may not import the package root)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("kvindex")
    except PackageNotFoundError:  # importable without being installed: nothing says which version
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvindex",
        description="Cross-pod KV-cache indexer for vLLM fleets.",
        epilog="Run `kvindex COMMAND --help` for a command's options.",
    )
    parser.add_argument(
        "--version", action="version", version=f"kvindex {version()}", help="print the version and exit"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module: Subcommand = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.configure(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The `kvindex` entry point: the subcommand's exit code; no subcommand prints help, exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(run(args))
    except CliError as exc:
        print(f"kvindex {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
