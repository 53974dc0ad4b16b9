"""A simulated vLLM engine: a prefix cache with vLLM's BlockPool rules publishing vLLM's exact KV-event bytes
(PUB + replay ROUTER) and serving `/v1/completions`, for the demo, tests and benchmarks."""
