"""vLLM's KV-event protocol and nothing of kvindex: wire Structs, frames, endpoint rules, the publisher with
its replay ring, the replay client, the SUB poller and the per-stream sequence tracker (reusable as is)."""
