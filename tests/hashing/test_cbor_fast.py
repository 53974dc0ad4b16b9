"""hashing/cbor_fast.py's token table: built on first use by a *_cbor algorithm, never by import or by the
pickle algorithms, exactly once even when threads race for it, and still byte-exact against vLLM.

Each check runs in a fresh interpreter: this test process has built the table already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

VECTORS = Path(__file__).resolve().parent.parent / "vectors" / "hash-vectors.json"

LAZY_PROBE = """
import json, sys
from kvindex.hashing import BlockHasher, cbor_fast

built = {"import": cbor_fast._token_table is not None}
for algo in ("sha256", "xxhash"):
    BlockHasher(algo, 16, "0").block_hashes(list(range(1000)))
built["sha256 and xxhash hashing"] = cbor_fast._token_table is not None
document = json.load(open(sys.argv[1], encoding="utf-8"))
case = next(c for c in document["cases"] if c["id"] == "sha256_cbor/seed=0/bs=16/len=8192")
hasher = BlockHasher(case["algo"], case["block_size"], case["seed"])
built["sha256_cbor hasher"] = cbor_fast._token_table is not None
digests = hasher.block_hashes(document["prompts"][case["prompt"]])
print(json.dumps({"built": built, "golden": [d.hex() for d in digests] == case["expected"]["block_hashes_hex"]}))
"""

RACE_PROBE = """
import threading
from kvindex.hashing import cbor_fast

barrier = threading.Barrier(8)
tables = []

def build():
    barrier.wait()
    tables.append(cbor_fast.token_table())

threads = [threading.Thread(target=build) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(len(tables), len({id(table) for table in tables}), tables[0] is cbor_fast.token_table())
"""


def _run(probe: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120, check=True
    )
    return result.stdout.strip()


def test_only_a_cbor_algorithm_builds_the_table_and_it_matches_vllm() -> None:
    report = json.loads(_run(LAZY_PROBE, str(VECTORS)))
    assert report["built"] == {
        "import": False,
        "sha256 and xxhash hashing": False,
        # The hasher builds it at construction, so a service's first request does not wait for it.
        "sha256_cbor hasher": True,
    }
    assert report["golden"], "sha256_cbor through the lazily built table differs from vLLM 0.33.0"


def test_threads_racing_for_the_table_share_one_build() -> None:
    assert _run(RACE_PROBE) == "8 1 True"
