"""The optional compiled cores (kvindex.hashing._chain, kvindex.indexer._shard and ._payload,
kvindex.api._id_arrays and ._answer); the rest is in pyproject.toml.

The hash core is built when a C compiler and OpenSSL's headers (Debian: libssl-dev) are present, the index
core, the request reader and the answer writer when a C compiler is. Without them the install still
succeeds, with a one-line warning per core, and kvindex runs the pure-Python reference in its place.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

_BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError)


def _warn(exc: Exception, what: str = "compiled cores were") -> None:
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    print(
        f"WARNING: kvindex's {what} not built ({message}); the pure-Python path will run",
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
            _warn(exc, f"compiled core {ext.name} was")


setup(
    ext_modules=[
        Extension(
            "kvindex.hashing._chain",
            sources=["hashing/_chain.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2"],
        ),
        Extension(
            "kvindex.indexer._shard",
            sources=["indexer/_shard.c"],
            depends=["indexer/shard_table.h"],
            extra_compile_args=["-O2"],
        ),
        Extension("kvindex.indexer._payload", sources=["indexer/_payload.c"], extra_compile_args=["-O2"]),
        Extension("kvindex.api._id_arrays", sources=["api/_id_arrays.c"], extra_compile_args=["-O2"]),
        Extension("kvindex.api._answer", sources=["api/_answer.c"], extra_compile_args=["-O2"]),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
