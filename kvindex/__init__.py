"""kvindex: a cross-pod KV-cache indexer for vLLM fleets.

The code lives in the top-level folders hashing/, replay/, indexer/, sim/, api/, demo/ and cli/, installed
as kvindex.<folder> (pyproject's package-dir); README.md's Layout says what each owns and may import.
"""

__version__ = "0.1.0"  # the one place: pyproject reads it (dynamic version), `kvindex --version` prints it
