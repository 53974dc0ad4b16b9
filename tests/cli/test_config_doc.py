"""docs/CONFIGURATION.md is what cli/config_doc.py prints, and what it prints covers every setting: each
IngestSettings, ApiSettings, ModelConfig and PodConfig field has a TOML key (or says where it comes from),
each key a meaning, and each flag's "(default X)" agrees with the key's default."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from kvindex.api.settings import ApiSettings
from kvindex.cli import cmd_serve, config, config_doc
from kvindex.cli.main import build_parser
from kvindex.indexer.ingest import IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md"

# Where each settings field is set in the TOML file (section, key).
API_KEYS = {
    "host": ("top level", "http"),
    "port": ("top level", "http"),
    "max_body_bytes": ("[limits]", "max_body_bytes"),
    "max_tokens": ("[limits]", "max_tokens"),
    "tier_weights": ("[tiers]", "weights"),
    "unknown_tier_weight": ("[tiers]", "unknown_weight"),
    "hash_in_executor_min_tokens": ("[limits]", "hash_in_executor_min_tokens"),
    "min_live_pods": ("top level", "min_live_pods"),
    "api_key": ("top level", "api_key"),
}
POD_KEYS = {
    "pod_id": "id",
    "endpoint": "endpoint",
    "model": "model",
    "replay_endpoint": "replay",
    "dp_rank": "dp_rank",
    "snapshot_url": "snapshot",
}


def test_the_committed_page_is_what_the_generator_prints() -> None:
    assert DOC.read_text() == config_doc.render(), (
        f"docs/CONFIGURATION.md is stale: run `{config_doc.GENERATOR}` and commit it"
    )


def test_the_generator_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvindex.cli.config_doc"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout == DOC.read_text()


def toml_keys() -> dict[str, set[str]]:
    return {
        heading: {field.name for field in msgspec.structs.fields(struct)}
        for heading, struct in config_doc.sections()
    }


def names(struct: type[msgspec.Struct]) -> set[str]:
    return {field.name for field in msgspec.structs.fields(struct)}


def test_every_ingest_setting_is_an_ingest_key_with_the_same_default() -> None:
    assert names(IngestSettings) == toml_keys()["[ingest]"] | set(config.INGEST_FIELDS_ELSEWHERE)
    section = config._IngestSection()
    for key in toml_keys()["[ingest]"]:
        assert getattr(section, key) == getattr(IngestSettings(), key), key


def test_every_api_setting_model_and_pod_field_has_a_key() -> None:
    keys = toml_keys()
    assert set(API_KEYS) == names(ApiSettings)
    for section, key in API_KEYS.values():
        assert key in keys[section], (section, key)
    assert keys["[[models]]"] == names(ModelConfig)
    assert set(POD_KEYS) == names(PodConfig) and set(POD_KEYS.values()) == keys["[[pods]]"]


def test_every_ingest_key_reaches_ingest_settings(tmp_path: Path) -> None:
    changed = {}
    for key in sorted(toml_keys()["[ingest]"]):
        default = getattr(IngestSettings(), key)
        changed[key] = default * 2 if default else 1  # 0 defaults become 1; every key is numeric today
    text = "[[models]]\nname = 'm'\n[ingest]\n" + "".join(
        f"{key} = {value!r}\n" for key, value in changed.items()
    )
    path = tmp_path / "kvindex.toml"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    cmd_serve.configure(parser)
    args = parser.parse_args(["--config", str(path), "--pod", "p=tcp://h:1"])
    ingest = config.build_serve_config(args, {}).ingest
    assert {key: getattr(ingest, key) for key in changed} == changed


def test_every_key_has_a_meaning() -> None:
    for _, struct in config_doc.sections():
        for doc in config_doc.key_docs(struct):
            assert len(doc.meaning) > 20, (struct.__name__, doc.name)


@pytest.mark.parametrize(
    "dest", [a.dest for a in config_doc._actions(config_doc._subparsers(build_parser())["serve"])]
)
def test_a_serve_flag_says_the_default_of_its_key(dest: str) -> None:
    serve = config_doc._subparsers(build_parser())["serve"]
    (action,) = [a for a in config_doc._actions(serve) if a.dest == dest]
    said = re.search(r"\(default ([^;),]+)", action.help or "")
    target = config_doc.serve_flag_key(dest)
    if said is None or target is None:
        return
    section, key = target
    struct = dict(config_doc.sections())[section]
    (doc,) = [d for d in config_doc.key_docs(struct) if d.name == key]
    written = said.group(1).strip()
    try:
        assert float(written) == float(doc.default.replace("_", "")), (dest, written, doc.default)
    except ValueError:
        assert written == doc.default.strip('"'), (dest, written, doc.default)
