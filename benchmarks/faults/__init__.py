"""A fault-schedule harness for kvindex's ingest lifecycle: seeded schedules of engine and kvindex
faults over real ZMQ, judged at quiescence against each engine's own cache, shrunk when they fail.

`python -m benchmarks.faults --schedules N` prints a table per fault kind. Tests import `generate`,
`run_schedule` and `shrink` from here.
"""
