"""The one error type of the hashing core.

Every bad input to block hashing (tokens, block size, algorithm, seed, extra keys) raises `HashingError`
with one sentence saying what to fix; the HTTP and CLI shells turn it into a 4xx / exit code 2.
"""

from __future__ import annotations


class HashingError(ValueError):
    """An input that vLLM's hashing would reject, or that no vLLM engine could ever have hashed."""
