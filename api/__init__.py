"""The HTTP read path and status: `POST /v1/score` (validate -> block hashes -> lookup -> scores -> JSON),
`/v1/pods`, `/metrics`, `/healthz`, `/readyz`, on aiohttp."""
