"""`kvindex hash` and `kvindex compat vectors` run as a user runs them: `python -m kvindex` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvindex.cli.main import main

VECTORS_FILE = Path(__file__).resolve().parent.parent / "vectors" / "hash-vectors.json"


def kvindex(*args: str, env_seed: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    return subprocess.run(
        [sys.executable, "-m", "kvindex", *args], capture_output=True, text=True, timeout=120, env=env
    )


def assert_one_sentence_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr


def test_compat_reports_every_case_passed() -> None:
    result = kvindex("compat", "vectors", str(VECTORS_FILE))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "327 passed, 0 failed, 0 skipped"


def test_compat_json_report() -> None:
    result = kvindex("compat", "vectors", str(VECTORS_FILE), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"total": 327, "passed": 327, "failed": [], "skipped": []}


def _corrupted_copy(tmp_path: Path, case_id: str, block: int) -> Path:
    document = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
    case = next(c for c in document["cases"] if c["id"] == case_id)
    digest = case["expected"]["block_hashes_hex"][block]
    case["expected"]["block_hashes_hex"][block] = ("0" if digest[0] != "0" else "1") + digest[1:]
    path = tmp_path / "corrupted.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def test_compat_names_exactly_the_corrupted_case_and_block(tmp_path: Path) -> None:
    path = _corrupted_copy(tmp_path, "sha256_cbor/seed=42/bs=16/len=1000", 37)
    result = kvindex("compat", "vectors", str(path), "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["failed"] == [{"id": "sha256_cbor/seed=42/bs=16/len=1000", "first_bad_block": 37}]
    assert report["passed"] == 326 and report["skipped"] == []
    human = kvindex("compat", "vectors", str(path))
    assert human.returncode == 1
    assert "FAIL sha256_cbor/seed=42/bs=16/len=1000: first bad block 37" in human.stdout
    assert "326 passed, 1 failed, 0 skipped" in human.stdout


def test_compat_skips_what_it_cannot_compute_and_never_passes_it(tmp_path: Path) -> None:
    document = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
    first = dict(document["cases"][0])
    document["cases"] = [
        {**first, "id": "new-algo", "algo": "sha512"},
        {**first, "id": "random-root", "algo": "xxhash", "seed": None},
        {**first, "id": "new-field", "sliding_window": 128},
    ]
    path = tmp_path / "future.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    result = kvindex("compat", "vectors", str(path), "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["passed"] == 0 and report["failed"] == []
    reasons = {skip["id"]: skip["reason"] for skip in report["skipped"]}
    assert set(reasons) == {"new-algo", "random-root", "new-field"}
    assert "sha512" in reasons["new-algo"]
    assert "PYTHONHASHSEED" in reasons["random-root"]
    assert "sliding_window" in reasons["new-field"]


def _write(tmp_path: Path, content: Any) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("this is not json", "not valid JSON"),
        ([1, 2, 3], "JSON object"),
        ({"format": "something-else/2", "prompts": {}, "cases": []}, "format"),
        ({"format": "kvindex-hash-vectors/1", "cases": []}, "prompts"),
        ({"format": "kvindex-hash-vectors/1", "prompts": {"p": [1]}, "cases": [{"id": "x"}]}, "malformed"),
        (
            {
                "format": "kvindex-hash-vectors/1",
                "prompts": {"p": [1]},
                "cases": [
                    {
                        "id": "x",
                        "algo": "sha256",
                        "seed": "0",
                        "block_size": "16",
                        "prompt": "p",
                        "expected": {
                            "root_hex": "",
                            "block_hashes_hex": [],
                            "event_hashes": [],
                            "event_extra_keys": [],
                        },
                    }
                ],
            },
            "block_size",
        ),
    ],
)
def test_compat_malformed_file_is_one_sentence(tmp_path: Path, content: Any, needle: str) -> None:
    assert_one_sentence_error(kvindex("compat", "vectors", str(_write(tmp_path, content))), needle)


def test_compat_missing_file(tmp_path: Path) -> None:
    assert_one_sentence_error(kvindex("compat", "vectors", str(tmp_path / "nope.json")), "cannot read")


def test_hash_matches_a_vector_case() -> None:
    document = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
    case = next(c for c in document["cases"] if c["id"] == "sha256/seed=0/lora_mm_salt_combined")
    tokens = document["prompts"][case["prompt"]]
    mm = [f"{m['identifier']}:{m['offset']}:{m['length']}" for m in case["mm"]]
    args = ["hash", "--algo", "sha256", "--block-size", "16", "--seed", "0"]
    args += [
        "--lora-name",
        case["lora"]["name"],
        "--lora-path",
        case["lora"]["path"],
        "--cache-salt",
        case["cache_salt"],
    ]
    for spec in mm:
        args += ["--mm", spec]
    result = kvindex(*args, "--tokens", ",".join(map(str, tokens)))
    assert result.returncode == 0, result.stderr
    expected = case["expected"]
    assert json.loads(result.stdout) == {
        "root_hex": expected["root_hex"],
        "block_hashes_hex": expected["block_hashes_hex"],
        "event_hashes": expected["event_hashes"],
    }


def test_hash_seed_defaults_to_pythonhashseed(tmp_path: Path) -> None:
    document = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
    case = next(c for c in document["cases"] if c["id"] == "xxhash_cbor/seed=42/bs=16/len=1000")
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(document["prompts"][case["prompt"]]), encoding="utf-8")
    result = kvindex("hash", "--algo", "xxhash_cbor", "--tokens-file", str(tokens_file), env_seed="42")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["block_hashes_hex"] == case["expected"]["block_hashes_hex"]


def test_hash_unset_seed_uses_vllms_fixed_root_for_sha256() -> None:
    result = kvindex("hash", "--tokens", "1,2,3")
    assert result.returncode == 0, result.stderr
    # sha256(pickle("vllm-none-hash")), vLLM 0.33.0's NONE_HASH with PYTHONHASHSEED unset (spec §4.8)
    assert json.loads(result.stdout)["root_hex"].startswith("066b1e89")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--algo", "xxhash", "--tokens", "1,2"], "PYTHONHASHSEED"),
        (["--algo", "md5", "--seed", "0", "--tokens", "1,2"], "unknown hash algorithm"),
        (["--block-size", "0", "--seed", "0", "--tokens", "1,2"], "block_size"),
        (["--block-size", "-3", "--seed", "0", "--tokens", "1,2"], "block_size"),
        (["--seed", "0", "--tokens", "1,2,x"], "--tokens"),
        (["--seed", "0", "--tokens", "1,-2"], "non-negative"),
        (["--seed", "0", "--tokens", "1", "--mm", "img"], "IDENTIFIER:OFFSET:LENGTH"),
        (["--seed", "0", "--tokens", "1", "--mm", "img:a:3"], "integers"),
        (["--seed", "0", "--tokens", "1", "--mm", "img:0:0"], "length"),
        (["--seed", "0", "--tokens", "1", "--mm", "img:5:2", "--mm", "x:1:2"], "sorted"),
        (["--seed", "0", "--tokens", "1", "--lora-name", "a"], "lora_path"),
    ],
)
def test_hash_bad_input_is_one_sentence(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # In-process through the real dispatcher (a subprocess per case would dominate the test time).
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert main(["hash", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert needle in captured.err


def test_hash_bad_input_in_a_subprocess_has_no_traceback() -> None:
    assert_one_sentence_error(kvindex("hash", "--seed", "0", "--tokens", "1,-2"), "non-negative")


@pytest.mark.parametrize("content", ["[1, true]", "[1, 2.5]", '{"a": 1}', "not json"])
def test_hash_bad_tokens_file(tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content, encoding="utf-8")
    assert main(["hash", "--seed", "0", "--tokens-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "token" in err
