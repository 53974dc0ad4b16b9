"""The layer table and the pure core, checked by parsing every module's imports (module level and inside
functions) with `ast`. Files map to layers through pyproject's [tool.setuptools.package-dir]; a failure
names file:line and the forbidden arrow.

Layers (who may import whom, of kvindex; "may import X" includes everything X may import):

    hashing  -> nothing            replay -> nothing outside replay
    indexer  -> hashing, replay    sim    -> hashing, replay
    api      -> hashing, indexer   demo   -> sim, api, indexer, sidecar
    sidecar  -> hashing, replay, indexer
    cli      -> everything         kvindex (root package) -> cli
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_ROOT = "kvindex"

DIRECT_IMPORTS: dict[str, frozenset[str]] = {
    "hashing": frozenset(),
    "replay": frozenset(),
    "indexer": frozenset({"hashing", "replay"}),
    "sim": frozenset({"hashing", "replay"}),
    "api": frozenset({"hashing", "indexer"}),
    "sidecar": frozenset({"hashing", "replay", "indexer"}),
    "demo": frozenset({"sim", "api", "indexer", "sidecar"}),
    "cli": frozenset({"hashing", "replay", "indexer", "sim", "api", "sidecar", "demo"}),
    "kvindex": frozenset({"cli"}),
}

# Synchronous code with no sockets, threads or clocks: a whole folder (ends in "/") or one file.
PURE = (
    "hashing/",
    "replay/frames.py",
    "replay/wire.py",
    "replay/endpoints.py",
    "replay/sequence.py",
    "indexer/events.py",
    "indexer/decode.py",
    "indexer/convert.py",
    "indexer/index.py",
    "indexer/shard.py",
    "indexer/compiled.py",
    # (and what a C extension of the package resolves to: kvindex.indexer._shard, from indexer/_shard.c)
    "indexer/__init__.py",
    "indexer/store.py",
    "indexer/scorer.py",
    "indexer/hash_check.py",
    "indexer/model.py",
    "indexer/snapshot.py",
    "sidecar/state.py",
)
# Implementations of a pure interface that necessarily do IO, each with the reason. They sit in the same
# layer as the pure core they implement but are never pure: no pure module may import them (the check
# above names such an import), and the process shell (cli) builds them.
IO_SHELLS: dict[str, str] = {
    # The Redis/Valkey store implements indexer/store.py's Store over a network server (redis-py
    # sockets, a lock around its caches); the pure in-memory KVIndex stays the default.
    "indexer/stores/redis_store.py": "network client of a shared store",
}
# Listed before they exist (being split out of another module): checked once they appear.
NOT_YET_WRITTEN = frozenset({"indexer/shard.py"})

# Import roots a pure module may not touch, and why.
IMPURE_ROOTS: dict[str, str] = {
    "zmq": "sockets",
    "socket": "sockets",
    "aiohttp": "sockets",
    "threading": "threads",
    "_thread": "threads",
    "concurrent.futures": "threads",
    "multiprocessing": "threads",
    "asyncio": "threads",
    "time": "clocks",
    "datetime": "clocks",
}
# Containers that hold state when bound at module level and changed later.
MUTABLE_FACTORIES = frozenset(
    {"list", "dict", "set", "bytearray", "defaultdict", "deque", "Counter", "OrderedDict", "count"}
)
MUTATING_METHODS = frozenset(
    {
        "append", "extend", "insert", "pop", "popitem", "popleft", "clear", "update", "setdefault",
        "add", "discard", "remove", "appendleft", "move_to_end", "__setitem__", "__next__",
    }
)  # fmt: skip

# Violations known today and owned elsewhere: (file, what it imports). The test fails on any violation
# not listed here and on any entry that no longer occurs (delete it once fixed).
KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset(
    {
        # DigestMemo (inside BlockHasher) is documented as safe to share between threads: one
        # threading.Lock around every read-modify of its LRU dicts.
        ("hashing/memo.py", "threading"),
        # The CBOR token table is a constant that only *_cbor hashers need (~12 MB), so it is built on
        # first use, not at import: stored once through `global`, under a threading.Lock so threads
        # racing for it share one build.
        ("hashing/cbor_fast.py", "threading"),
        ("hashing/cbor_fast.py", "_token_table"),
        # KVIndex and its shards hold a threading.Lock each so ingest workers and readers can share them.
        ("indexer/index.py", "threading"),
    }
)


@dataclass(frozen=True)
class Violation:
    path: str  # relative to the repository root
    line: int
    imported: str  # what the line imports: a module name, or the file of a kvindex module, or a state's name
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass(frozen=True)
class Layout:
    """Where kvindex's modules are: pyproject's package-dir (dotted package -> folder) and the .py files."""

    dirs: dict[str, str]
    files: frozenset[str]

    @classmethod
    def of_repository(cls, root: Path = ROOT) -> Layout:
        with open(root / "pyproject.toml", "rb") as f:
            dirs: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
        files = frozenset(
            p.relative_to(root).as_posix()
            for folder in {d.split("/")[0] for d in dirs.values()}
            for p in (root / folder).rglob("*.py")
            if "__pycache__" not in p.parts
        )
        return cls(dirs, files)

    def layer(self, path: str) -> str:
        """The top-level folder a file sits in; the table's rows."""
        return path.split("/")[0]

    def module(self, path: str) -> str:
        """`indexer/ingest/service.py` -> `kvindex.indexer.ingest.service`."""
        folder, _, filename = path.rpartition("/")
        packages = [pkg for pkg, d in self.dirs.items() if d == folder]
        assert packages, f"{path}: its folder is not in [tool.setuptools.package-dir]"
        stem = filename.removesuffix(".py")
        return packages[0] if stem == "__init__" else f"{packages[0]}.{stem}"

    def file(self, name: str) -> str:
        """The file a dotted kvindex name is defined in: `kvindex.indexer.index.KVIndex` ->
        `indexer/index.py`, `kvindex.hashing.BlockHasher` -> `hashing/__init__.py` (a re-export)."""
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            folder = self.dirs.get(".".join(parts[:end]))
            if folder is not None:
                if end < len(parts) and f"{folder}/{parts[end]}.py" in self.files:
                    return f"{folder}/{parts[end]}.py"
                return f"{folder}/__init__.py"
        raise AssertionError(f"{name} is in no package of package-dir")


def allowed_layers(layer: str) -> frozenset[str]:
    """The layer itself, what it may import, and everything those may import."""
    seen = {layer}
    todo = [layer]
    while todo:
        for below in DIRECT_IMPORTS[todo.pop()]:
            if below not in seen:
                seen.add(below)
                todo.append(below)
    return frozenset(seen)


def is_pure(path: str) -> bool:
    return any(path.startswith(entry) if entry.endswith("/") else path == entry for entry in PURE)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted name) for every import anywhere in the tree, functions included: `import a.b` -> a.b,
    `from a import b` -> a.b (b may be a submodule or a name); relative imports resolved against `module`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                yield node.lineno, base if alias.name == "*" else f"{base}.{alias.name}"


def _is_under(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def _is_container(value: ast.expr | None) -> bool:
    if isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in MUTABLE_FACTORIES
    return False


def module_state(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """(line, name, how) for state a module keeps: a name rebound through `global`, or a module-level
    container the module itself changes. A container only read (a table, a shared empty default) is not."""
    containers: set[str] = set()
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and _is_container(statement.value):
            containers.update(t.id for t in statement.targets if isinstance(t, ast.Name))
        elif (
            isinstance(statement, ast.AnnAssign)
            and _is_container(statement.value)
            and isinstance(statement.target, ast.Name)
        ):
            containers.add(statement.target.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                yield node.lineno, name, "rebound through `global`"
        elif isinstance(node, ast.Call):
            func, args = node.func, node.args
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if func.value.id in containers and func.attr in MUTATING_METHODS:
                    yield node.lineno, func.value.id, f"changed by .{func.attr}()"
            elif getattr(func, "id", "") == "next" and args and isinstance(args[0], ast.Name):
                if args[0].id in containers:
                    yield node.lineno, args[0].id, "advanced by next()"
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.target if isinstance(node, ast.AugAssign) else node.targets
            for target in targets if isinstance(targets, list) else [targets]:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    if target.value.id in containers:
                        yield node.lineno, target.value.id, "changed by item assignment"


def check_source(path: str, source: str, layout: Layout) -> list[Violation]:
    """Every forbidden arrow in one file; for a pure module also every socket, thread or clock import,
    every import of a kvindex module that is not pure, and module-level state."""
    layer = layout.layer(path)
    assert layer in DIRECT_IMPORTS, f"{path}: folder {layer!r} has no row in the layer table (test_layers.py)"
    tree = ast.parse(source, filename=path)
    allowed = allowed_layers(layer)
    pure = is_pure(path)
    found: dict[tuple[int, str], Violation] = {}  # one report per (line, what)
    for line, name in imported_names(tree, layout.module(path), path.endswith("/__init__.py")):
        if _is_under(name, PACKAGE_ROOT):
            target_file = layout.file(name)
            target = layout.layer(target_file)
            if target not in allowed:
                arrow = f"{layer} -> {target} ({name}) is not in the layer table"
                found.setdefault((line, target), Violation(path, line, target, arrow))
            elif pure and not is_pure(target_file):
                why = f"pure module imports {name}, which is not pure ({target_file})"
                found.setdefault((line, target_file), Violation(path, line, target_file, why))
        elif pure:
            for root, kind in IMPURE_ROOTS.items():
                if _is_under(name, root):
                    why = f"pure module imports {name} ({kind})"
                    found.setdefault((line, root), Violation(path, line, root, why))
    if pure:
        for line, name, how in module_state(tree):
            why = f"pure module keeps module-level state: {name} {how}"
            found.setdefault((line, name), Violation(path, line, name, why))
    return list(found.values())


def check_tree(root: Path = ROOT) -> list[Violation]:
    """Every violation in a checkout (`python tests/test_layers.py [ROOT]` prints them)."""
    layout = Layout.of_repository(root)
    return [v for path in sorted(layout.files) for v in check_source(path, (root / path).read_text(), layout)]


# --- this repository ------------------------------------------------------------------------------------

LAYOUT = Layout.of_repository()


def test_every_package_folder_has_a_row_in_the_layer_table() -> None:
    layers = {d.split("/")[0] for d in LAYOUT.dirs.values()}
    assert layers <= set(DIRECT_IMPORTS), f"add a row to DIRECT_IMPORTS for {layers - set(DIRECT_IMPORTS)}"


def test_every_module_listed_as_pure_exists() -> None:
    missing = [
        entry
        for entry in PURE
        if entry not in NOT_YET_WRITTEN and not any(f == entry or f.startswith(entry) for f in LAYOUT.files)
    ]
    assert missing == [], f"listed as pure but not found (renamed?): {missing}"


def test_io_shells_exist_and_are_not_listed_as_pure() -> None:
    for path in IO_SHELLS:
        assert path in LAYOUT.files, f"IO shell {path} not found (renamed?)"
        assert not is_pure(path), f"{path} does IO ({IO_SHELLS[path]}): it cannot be pure"


def test_imports_follow_the_layer_table_and_the_pure_core_stays_pure() -> None:
    found = check_tree()
    new = [str(v) for v in found if (v.path, v.imported) not in KNOWN_VIOLATIONS]
    assert new == [], "forbidden imports:\n" + "\n".join(new)
    stale = KNOWN_VIOLATIONS - {(v.path, v.imported) for v in found}
    assert not stale, f"fixed now: remove from KNOWN_VIOLATIONS {sorted(stale)}"


# --- the rule itself can fail ---------------------------------------------------------------------------

TOY = Layout(
    dirs={
        "kvindex": "kvindex",
        "kvindex.hashing": "hashing",
        "kvindex.replay": "replay",
        "kvindex.indexer": "indexer",
        "kvindex.indexer.ingest": "indexer/ingest",
        "kvindex.api": "api",
        "kvindex.cli": "cli",
    },
    files=frozenset(
        {
            "indexer/events.py",
            "indexer/index.py",
            "indexer/ingest/service.py",
            "replay/wire.py",
            "cli/main.py",
        }
    ),
)


@pytest.mark.parametrize(
    ("path", "source", "arrow"),
    [
        ("replay/wire.py", "from kvindex.indexer.events import PodRef", "replay -> indexer"),
        ("replay/subscriber.py", "def f():\n    import kvindex.indexer.ingest.service", "replay -> indexer"),
        ("hashing/hasher.py", "from kvindex import api", "hashing -> api"),
        ("api/app.py", "from kvindex.cli.main import main", "api -> cli"),
        ("cli/main.py", "from kvindex import __version__", "cli -> kvindex"),
        ("indexer/ingest/service.py", "from ... import cli", "indexer -> cli"),
        ("indexer/ingest/service.py", "from ...api import app", "indexer -> api"),
    ],
)
def test_a_forbidden_arrow_is_named_with_its_file_and_line(path: str, source: str, arrow: str) -> None:
    found = check_source(path, "import json\n" + source + "\n", TOY)
    line = 2 + source.count("\n")  # the import is the source's last line
    assert [str(v).partition(" (")[0] for v in found] == [f"{path}:{line}: {arrow}"]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import zmq", "zmq"),
        ("from concurrent.futures import ThreadPoolExecutor", "concurrent.futures"),
        ("from concurrent import futures", "concurrent.futures"),
        ("def now():\n    import time\n    return time.monotonic()", "time"),
        ("from datetime import datetime", "datetime"),
        ("import asyncio.events", "asyncio"),
        ("from kvindex.indexer.ingest import IngestService", "indexer/ingest/__init__.py"),
        ("from .ingest import service", "indexer/ingest/service.py"),
        ("SEEN = {}\ndef f(k):\n    SEEN[k] = 1", "SEEN"),
        ("_ids = []\ndef f(x):\n    _ids.append(x)", "_ids"),
        ("import itertools\n_c = itertools.count()\ndef f():\n    return next(_c)", "_c"),
        ("seed = 0\ndef f():\n    global seed\n    seed += 1", "seed"),
    ],
)
def test_a_pure_module_may_not_use_sockets_threads_clocks_impure_modules_or_state(
    source: str, expected: str
) -> None:
    found = check_source("indexer/scorer.py", source + "\n", TOY)
    assert [v.imported for v in found] == [expected], [str(v) for v in found]
    assert check_source("indexer/ingest/service.py", source + "\n", TOY) == []  # not pure: allowed


def test_allowed_arrows_and_read_only_tables_pass() -> None:
    source = (
        "from kvindex.hashing import BlockHasher\n"
        "from kvindex.replay import wire\n"
        "import kvindex.indexer.events\n"
        "from .index import KVIndex\n"
        "TABLE = {'a': 1}\n"
        "_NO_DROPS: dict[str, int] = {}\n"
        "def f(k):\n    local = {}\n    local[k] = TABLE[k]\n    return local\n"
    )
    assert check_source("indexer/scorer.py", source, TOY) == []
    assert check_source("cli/main.py", "from kvindex.api.app import create_app\n", TOY) == []
    assert check_source("kvindex/__main__.py", "from kvindex.cli.main import main\n", TOY) == []
    assert allowed_layers("demo") == {"demo", "sim", "api", "sidecar", "indexer", "hashing", "replay"}


if __name__ == "__main__":
    import sys

    for violation in check_tree(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(violation)
