"""The `kvindex` dispatcher (cli/main.py): start-up stays light, no subcommand prints help and exits 2,
every subcommand answers --help.

(Named test_kvindex_cli.py: tests/hashing/test_cli.py already owns the basename test_cli.py, and
pytest's rootdir-style collection needs unique basenames.)
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
from kvindex.cli import main as cli

import kvindex

# Paid only by the subcommand that needs them, never by building the parser. (kvindex.hashing is allowed:
# the subcommands take HASH_ALGOS from it, and its import is light; its CBOR table is checked below. So is
# kvindex.replay.endpoints, pure string functions the config checks addresses with.)
HEAVY_ROOTS = ("aiohttp", "zmq", "prometheus_client")
HEAVY_PACKAGES = ("kvindex.indexer", "kvindex.replay")
LIGHT_MODULES = ("kvindex.replay", "kvindex.replay.endpoints")

PROBE = (
    "import kvindex.cli.main as c; c.build_parser(); import sys; "
    "print(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r} "
    "or (any(m == p or m.startswith(p + '.') for p in {packages!r}) and m not in {light!r})))"
)


def test_building_the_parser_imports_no_heavy_module() -> None:
    # A fresh interpreter: this test process has imported everything already.
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(roots=HEAVY_ROOTS, packages=HEAVY_PACKAGES, light=LIGHT_MODULES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_building_the_parser_and_hashing_with_sha256_leave_the_cbor_table_unbuilt() -> None:
    # `kvindex --help` and `kvindex hash` (default sha256) must not pay for the ~12 MB table only the
    # *_cbor algorithms use.
    probe = (
        "import kvindex.cli.main as c; c.build_parser(); "
        "assert c.main(['hash', '--tokens', '1,2,3,4', '--block-size', '2', '--seed', '0']) == 0; "
        "from kvindex.hashing import cbor_fast; print(cbor_fast._token_table is None)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "True", result.stdout


def test_no_subcommand_prints_help_and_exits_2() -> None:
    result = subprocess.run([sys.executable, "-m", "kvindex"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: kvindex")
    for name in cli.SUBCOMMANDS:
        assert name in result.stderr
    assert result.stdout == ""


def test_every_subcommand_is_registered() -> None:
    parser = cli.build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]  # noqa: SLF001
    assert set(subparsers.choices) == set(cli.SUBCOMMANDS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "argv", [[name, "--help"] for name in cli.SUBCOMMANDS] + [["compat", "vectors", "--help"], ["--help"]]
)
def test_every_subcommand_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    prog = " ".join(["kvindex", *argv[:-1]])
    assert out.startswith(f"usage: {prog}"), out
    assert "--help" in out


def test_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_a_bad_flag_prints_the_subcommands_own_usage(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse's subparsers quirk: leftovers went up to the top-level parser, which printed
    # `usage: kvindex [-h] COMMAND ...` and none of the command's flags.
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvindex {name}"), err
    assert f"kvindex {name}" in err.splitlines()[-1]


def test_serve_with_a_bad_flag_names_it_under_serves_usage() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvindex", "serve", "--model", "m", "--bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("usage: kvindex serve [-h] [--http HOST:PORT]"), result.stderr
    assert "--pod ID=ENDPOINT" in result.stderr  # serve's flags, not the top-level COMMAND list
    assert result.stderr.splitlines()[-1] == "kvindex serve: error: unrecognized arguments: --bogus"


def test_a_nested_subcommand_reports_with_its_own_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compat", "vectors", "file.json", "--bogus"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("usage: kvindex compat vectors")


def test_version_is_the_installed_distributions() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvindex", "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout == f"kvindex {kvindex.__version__}\n"
    # pyproject takes its version from kvindex.__version__: the two cannot disagree (a stale install can).
    assert importlib.metadata.version("kvindex") == kvindex.__version__
