"""What an install carries beside the Python modules: the status page and the compiled cores' type stubs,
with setuptools (the build backend pyproject.toml names) finding nothing in the package layout to warn
about: a warning there today is a file left out of the wheel by a later setuptools."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_FILES = [
    "kvindex/api/static/status.html",
    "kvindex/api/_answer.pyi",
    "kvindex/api/_id_arrays.pyi",
    "kvindex/hashing/_chain.pyi",
    "kvindex/indexer/_payload.pyi",
    "kvindex/indexer/_shard.pyi",
]


def test_build_carries_the_status_page_and_the_stubs_without_a_warning(tmp_path: Path) -> None:
    # build_py only: what a wheel holds besides the compiled cores, without compiling them.
    built = subprocess.run(
        [sys.executable, "-W", "error", "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    for name in DATA_FILES:
        assert (tmp_path / name).is_file(), name
    page = (tmp_path / "kvindex/api/static/status.html").read_bytes()
    assert page == (ROOT / "api/static/status.html").read_bytes()
    assert (tmp_path / "kvindex/api/status_page.py").is_file()
    assert not list(tmp_path.rglob("*.c"))  # C sources travel in the sdist only
