"""The optional compiled hash core (kvindex.hashing._chain); everything else is in pyproject.toml.

The extension is built when a C compiler and OpenSSL's headers (Debian: libssl-dev) are present. Without
them the install still succeeds, with a one-line warning, and kvindex runs its pure-Python hash path.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

_BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError)


def _warn(exc: Exception) -> None:
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    print(
        f"WARNING: kvindex's compiled hash core was not built ({message}); the pure-Python path will run",
        file=sys.stderr,
    )


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed compile or link into a warning: the extension is an accelerator."""

    def run(self) -> None:
        try:
            super().run()
        except _BUILD_ERRORS as exc:
            _warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except _BUILD_ERRORS as exc:
            _warn(exc)


setup(
    ext_modules=[
        Extension(
            "kvindex.hashing._chain",
            sources=["hashing/_chain.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
