"""What the benchmarks share: the workloads (:mod:`.workloads`, standard library only), their
workspace and DDP trainings (:mod:`.workspace`), the one step timer (:mod:`.step_timer`) and
the one runner of a benchmark's fresh child processes (:mod:`.child`, standard library only)."""
