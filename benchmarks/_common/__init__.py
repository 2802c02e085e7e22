"""What the benchmarks share: the workloads (:mod:`.workloads`, standard library only) and
their workspace and DDP trainings (:mod:`.workspace`)."""
