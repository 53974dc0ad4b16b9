"""kvindex's domain: its own events, the one wire -> domain seam (decode, convert), the index, the scorer,
the hash check, and the ingest pipeline (indexer/ingest/) that keeps each model's index in step with its pods."""
