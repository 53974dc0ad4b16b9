"""docs/CONFIGURATION.md, generated: every TOML key and command-line flag, its default and its meaning.

Read from the structs `kvindex serve` loads its file into (cli/config.py: each key's type, bounds and
`Meta(description=...)`, defaults taken from IngestSettings, ApiSettings and ModelConfig) and from the
argparse parser itself, so the page cannot drift from the code: tests/cli/test_config_doc.py fails when
the committed page differs from what this prints.

    python -m kvindex.cli.config_doc > docs/CONFIGURATION.md
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from collections.abc import Iterator
from typing import Any, Union

import msgspec
from kvindex.cli import config
from kvindex.cli.main import build_parser
from msgspec import Meta

GENERATOR = "python -m kvindex.cli.config_doc > docs/CONFIGURATION.md"


class MemoryMeasurement(msgspec.Struct, frozen=True):
    """One run of the memory benchmark: redo it with `command` and update these figures."""

    command: str
    date: str
    workload: str
    pairs: int
    bytes_per_pair: float
    rss_before_mib: float


# `kvindex serve`'s RSS after ingest minus before, over the (pod, block) pairs indexed.
MEMORY = MemoryMeasurement(
    command="python -m benchmarks --only memory --no-dynamo",
    date="2026-12-01",
    workload="100 engines x 10,000 blocks, 10 shared prefixes of 256 blocks, block size 16; Python 3.11.7, "
    "shared 2-core box, the compiled index core (the pure-Python one: ~100 bytes per pair)",
    pairs=1_000_000,
    bytes_per_pair=43.7,
    rss_before_mib=51.4,
)
SIZING_PAIRS = (1_000_000, 10_000_000, 50_000_000, 100_000_000)

# --- the TOML side ------------------------------------------------------------------------------

_NAMES = {int: ("integer", "integers"), float: ("float", "floats"), str: ("string", "strings")}
_NAMES[bool] = ("boolean", "booleans")


def _split_meta(annotation: Any) -> tuple[Any, Meta | None]:
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extras = typing.get_args(annotation)
        return base, next((e for e in extras if isinstance(e, Meta)), None)
    return annotation, None


def _type_name(annotation: Any, *, plural: bool = False) -> str:
    base, _ = _split_meta(annotation)
    origin = typing.get_origin(base)
    if origin in (Union, types.UnionType):
        members = [arg for arg in typing.get_args(base) if arg is not type(None)]
        return " or ".join(_type_name(arg, plural=plural) for arg in members)
    if origin is list:
        (item,) = typing.get_args(base)
        return ("arrays of " if plural else "array of ") + _type_name(item, plural=True)
    if origin is dict:
        _, value = typing.get_args(base)
        return ("tables of " if plural else "table of ") + _type_name(value, plural=True)
    singular, plural_name = _NAMES[base]
    return plural_name if plural else singular


def _bounds(meta: Meta | None) -> str:
    if meta is None:
        return ""
    parts = [f">= {meta.ge}" if meta.ge is not None else "", f"> {meta.gt}" if meta.gt is not None else ""]
    return " ".join(part for part in parts if part)


def toml_value(value: object) -> str:
    """A value as an operator writes it in the TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = (f"{_toml_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{ " + ", ".join(items) + " }"
    raise TypeError(f"no TOML form for {value!r}")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


class KeyDoc(msgspec.Struct, frozen=True):
    name: str
    type: str
    default: str  # a TOML literal, "unset" or "required"
    meaning: str


def key_docs(struct: type[msgspec.Struct]) -> Iterator[KeyDoc]:
    """One row per plain key of a section (nested tables and arrays of tables are sections of their own)."""
    hints = typing.get_type_hints(struct, include_extras=True)
    for field in msgspec.structs.fields(struct):
        base, meta = _split_meta(hints[field.name])
        if _is_section(base):
            continue
        if meta is None or not meta.description:
            raise ValueError(f"{struct.__name__}.{field.name} has no Meta(description=...)")
        if field.default is not msgspec.NODEFAULT:
            default = "unset" if field.default is None else toml_value(field.default)
        elif field.default_factory is not msgspec.NODEFAULT:
            default = toml_value(field.default_factory())
        else:
            default = "required"
        kind = _type_name(base)
        bounds = _bounds(meta)
        yield KeyDoc(field.name, f"{kind} {bounds}" if bounds else kind, default, meta.description)


def _is_section(annotation: Any) -> bool:
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


def sections() -> list[tuple[str, type[msgspec.Struct]]]:
    """(heading, struct) of every part of the file, top level first, in the file struct's field order."""
    found: list[tuple[str, type[msgspec.Struct]]] = [("top level", config._ConfigFile)]
    hints = typing.get_type_hints(config._ConfigFile, include_extras=True)
    for field in msgspec.structs.fields(config._ConfigFile):
        base, _ = _split_meta(hints[field.name])
        if typing.get_origin(base) is list:
            (item,) = typing.get_args(base)
            if _is_section(item):
                found.append((f"[[{field.name}]]", item))
        elif _is_section(base):
            found.append((f"[{field.name}]", base))
    return found


# --- the flags ----------------------------------------------------------------------------------


# `kvindex serve` flags that set a key of the [store] table: argparse dest -> key.
STORE_FLAGS = {"store": "url", "lease_ttl": "lease_ttl_s", "replica_id": "replica_id"}


def serve_flag_key(dest: str) -> tuple[str, str] | None:
    """(section heading, key) a `kvindex serve` flag sets (`dest` is argparse's; key "" for a whole
    entry), or None for a flag with no TOML key."""
    if dest == "model":
        return "[[models]]", "name"
    if dest == "pod":
        return "[[pods]]", ""
    if dest in STORE_FLAGS:
        return "[store]", STORE_FLAGS[dest]
    if dest in {field.name for field in msgspec.structs.fields(config._ModelSection)}:
        return "[[models]]", dest
    if dest in {field.name for field in msgspec.structs.fields(config._ConfigFile)}:
        return "top level", dest
    return None


def _key_label(section: str, key: str) -> str:
    if section == "top level":
        return f"`{key}`"
    if section == "[[models]]" and key != "name":
        return f"`{section} {key}` of the `--model` model"
    return f"`{section} {key}`" if key else f"`{section}` (one entry)"


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions  # noqa: SLF001 (argparse has no public list of its arguments)
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)  # noqa: SLF001
    ]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return dict(action.choices)
    return {}


def flag_usage(action: argparse.Action) -> str:
    if not action.option_strings:
        return str(action.metavar or action.dest)
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    if action.metavar is not None:
        metavar = str(action.metavar)
    elif action.choices is not None:
        metavar = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        metavar = action.dest.upper()
    return f"{flags} {metavar}"


def flag_help(action: argparse.Action) -> str:
    text = " ".join((action.help or "").split())
    if "%(" in text:
        raise ValueError(f"{flag_usage(action)}: help uses argparse formatting the page would show raw")
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# --- the page -----------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return lines


def _docstring(struct: type) -> str:
    return " ".join((struct.__doc__ or "").split())


def render() -> str:
    """The whole of docs/CONFIGURATION.md."""
    parser = build_parser()
    commands = _subparsers(parser)
    serve = commands["serve"]
    flag_of: dict[tuple[str, str], str] = {}
    for action in _actions(serve):
        target = serve_flag_key(action.dest)
        if target is not None:
            flag_of[target] = action.option_strings[0]

    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{GENERATOR}` from cli/config.py and the command-line parser; "
        "tests/cli/test_config_doc.py fails when this page differs. Edit the code, then regenerate. -->",
        "",
        "`kvindex serve` is configured by flags and an optional TOML file (`--config FILE`). Flags override "
        "the file: a flag replaces the key it sets (`--listen` flags replace the whole `listen` list); "
        "`--model NAME` with `--block-size`, `--hash-algo` and `--hash-seed` adds a model or changes the "
        "file's entry of that name; a `--pod` with the id and DP rank of a `[[pods]]` entry replaces that "
        "entry (the start-up log names each pod's source). One (id, DP rank) given twice by the file, or "
        "twice by flags, is refused. Unknown keys are errors, and so are values out of bounds; every error "
        "is one sentence naming the key. Endpoints are checked before anything starts; a dialled host "
        "that does not resolve is a start-up WARNING, not an error (in Kubernetes a pod's DNS name may "
        "appear after kvindex starts).",
        "",
        "## The TOML file",
    ]
    for heading, struct in sections():
        out += ["", f"### {heading}", "", _docstring(struct), ""]
        rows = []
        for doc in key_docs(struct):
            flag = flag_of.get(
                (heading, doc.name), flag_of.get((heading, "")) if heading == "[[pods]]" else None
            )
            default = doc.default if doc.default in ("unset", "required") else f"`{doc.default}`"
            rows.append([f"`{doc.name}`", doc.type, default, f"`{flag}`" if flag else "", doc.meaning])
        out += _table(["key", "type", "default", "flag", "meaning"], rows)
    elsewhere = ", ".join(f"`{name}` from {where}" for name, where in config.INGEST_FIELDS_ELSEWHERE.items())
    out += ["", f"IngestSettings fields not in `[ingest]`: {elsewhere}."]

    out += ["", "## Flags of `kvindex serve`", ""]
    rows = []
    for action in _actions(serve):
        target = serve_flag_key(action.dest)
        rows.append([f"`{flag_usage(action)}`", _key_label(*target) if target else "", flag_help(action)])
    out += _table(["flag", "TOML key", "meaning"], rows)

    out += _memory_section()

    out += ["", "## The other commands", ""]
    out += _table(
        ["`kvindex` flag", "meaning"], [[f"`{flag_usage(a)}`", flag_help(a)] for a in _actions(parser)]
    )
    for name, sub in commands.items():
        if name == "serve":
            continue
        out += _command_flags(f"kvindex {name}", sub)
    return "\n".join(out) + "\n"


def _command_flags(prog: str, parser: argparse.ArgumentParser) -> list[str]:
    out = ["", f"### `{prog}`", "", " ".join((parser.description or "").split()), ""]
    actions = _actions(parser)
    if actions:
        out += _table(["flag", "meaning"], [[f"`{flag_usage(a)}`", flag_help(a)] for a in actions])
    for name, sub in _subparsers(parser).items():
        out += _command_flags(f"{prog} {name}", sub)
    return out


def _memory_section() -> list[str]:
    m = MEMORY
    rows = []
    for pairs in SIZING_PAIRS:
        note = "measured" if pairs == m.pairs else f"{pairs // m.pairs}x the measured run (linear)"
        rows.append([f"{pairs:,}", _size(pairs * m.bytes_per_pair), note])
    default_keys = config._IngestSection().index_max_keys
    return [
        "",
        "## Memory sizing",
        "",
        "The index costs memory per (pod, block) pair: a block held by k pods is k pairs. `index_max_keys` "
        "bounds the blocks per model and `index_max_pods_per_key` the pods per block, so the pairs are at "
        "most their product; a fleet of P pods with C cached blocks each has about P x C pairs. The index "
        f"of each model is sized separately. At the default `index_max_keys` ({default_keys:,}), a model "
        f"whose blocks are each held by one pod reaches about {_size(default_keys * m.bytes_per_pair)} "
        "before evicting; every further holder of a block adds a pair.",
        "",
        f"Measured {m.date} with `{m.command}` ({m.workload}): {m.bytes_per_pair} bytes per pair, the "
        f"process at {m.rss_before_mib} MiB before ingest. Redo the run and update "
        "`kvindex.cli.config_doc.MEMORY` after changing the index.",
        "",
        *_table(["(pod, block) pairs", "index memory", "how"], rows),
    ]


def _size(num_bytes: float) -> str:
    mib = num_bytes / 2**20
    return f"{mib:,.0f} MiB" if mib < 1024 else f"{mib / 1024:,.1f} GiB"


def main() -> int:
    print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
