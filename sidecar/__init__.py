"""`kvindex sidecar`: beside one engine, its KV-event stream relayed under the sidecar's own seq (never
reset while the sidecar lives; engine restarts and lost history become one AllBlocksCleared), plus the
pod's whole block set served as a snapshot, so a central kvindex resyncs exactly past the replay ring.

relay (engine stream -> downstream publisher + state) · state (pure block sets) · http (snapshot, status,
metrics) · service (wiring) · settings."""
