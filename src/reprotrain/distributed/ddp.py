"""DDP on Lightning's engine that reruns to the same bits, for a fixed world size.

Use it in any Lightning project::

    from reprotrain.distributed.ddp import RankAgreement, ddp_strategy, set_threads_per_rank

    set_threads_per_rank(devices)                 # before the run ID, before fit
    trainer = L.Trainer(strategy=ddp_strategy("gpu"), devices=devices, num_nodes=nodes,
                        use_distributed_sampler=False,  # build a seeded DistributedSampler
                        callbacks=[RankAgreement({"run_id": run_id})], ...)

What decides a DDP run's bits, beyond a single process's: the world size
(each rank's share of the data, and how many gradients the all-reduce
averages), the backend (gloo on CPU, NCCL on GPU), the gradient buckets
(``bucket_cap_mb``: NCCL reduces bucket by bucket) and, for NCCL, the
algorithm and protocol (``NCCL_ALGO``, ``NCCL_PROTO``: ring and tree sum in
different orders), which NCCL picks from the topology unless they are set.
:func:`distributed_layout` records all of them, so they can be part of a run
ID. :func:`ddp_strategy` pins the backend and the DDP options instead of
leaving them to Lightning's defaults, and :func:`set_threads_per_rank` fixes
each rank's CPU thread count before the run ID is computed (Lightning would
set it later, inside ``fit``).

The guarantee: the same code, data, params, world size, devices per node,
backend, collective settings and hardware give the same bits on every rank,
run after run. A different world size gives a different result (a different
run ID); so may another topology (another node count or interconnect) unless
``NCCL_ALGO`` and ``NCCL_PROTO`` are pinned. :class:`RankAgreement` fails
closed when ranks disagree on what they run (a node with another image, data
or GPU): every rank gathers every rank's facts after the process group is up.

:func:`gather_from_ranks` is how per-rank state reaches rank 0: the random
state in checkpoints (``reprotrain.resume``) and the per-rank trace
(``reprotrain.trace.callback``); :func:`own_entry` picks each rank's own back out. Both
work unchanged in a single process.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import warnings
from collections.abc import Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy

from reprotrain.determinism import Mode, refuse_or_warn
from reprotrain.provenance.environment import collective_variables

#: DDP options pinned here, not left to defaults that may change between versions.
DDP_OPTIONS: dict[str, Any] = {
    "bucket_cap_mb": 25,
    "find_unused_parameters": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
}
BACKENDS = {"cpu": "gloo", "gpu": "nccl"}


def ddp_strategy(accelerator: str) -> DDPStrategy:
    """Lightning's DDP (one process per device, started by Lightning or by the cluster).

    The backend is gloo for ``"cpu"`` and NCCL for ``"gpu"``, stated rather than
    inferred; the DDP options are :data:`DDP_OPTIONS`.
    """
    return DDPStrategy(process_group_backend=BACKENDS[accelerator], **DDP_OPTIONS)


def distributed_layout(
    strategy: str, accelerator: str, devices: int, num_nodes: int
) -> dict[str, Any]:
    """What shapes a run's reductions: world size, backend, DDP options, NCCL settings."""
    if strategy != "ddp":
        return {"strategy": strategy, "world_size": devices * num_nodes}
    return {
        "strategy": strategy,
        "world_size": devices * num_nodes,
        "num_nodes": num_nodes,
        "devices_per_node": devices,
        "backend": BACKENDS[accelerator],
        "ddp": dict(DDP_OPTIONS),
        "collective_variables": collective_variables(),
    }


def set_threads_per_rank(devices_per_node: int) -> int:
    """Give each of a node's ranks its share of the CPUs; ``OMP_NUM_THREADS`` wins if set.

    Lightning does the same inside ``fit``; doing it first makes the thread
    count (which can change CPU reduction order) visible to the run ID, and
    equal on every rank: the ranks Lightning starts inherit the variable.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        os.environ["OMP_NUM_THREADS"] = str(max(1, (cpus or 1) // devices_per_node))
    threads = int(os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(threads)
    return threads


def this_rank() -> int:
    """The global rank; 0 without a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks; 1 without a process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_from_ranks(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank; ``[obj]`` in a single process.

    A collective: every rank must call it at the same point. Objects travel
    pickled between the ranks of one job (never from a file).
    """
    if world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def own_entry(entries: list[Any], what: str, error: type[Exception] = ValueError) -> Any:
    """This rank's item of a :func:`gather_from_ranks` list read back (from a checkpoint).

    Raises ``error`` when the list was gathered under another world size.
    """
    if len(entries) != world_size():
        raise error(
            f"{what} of {len(entries)} ranks, this run has {world_size()}: resume with the "
            "world size it was written with"
        )
    return entries[this_rank()]


#: What the fork server imports before it forks a worker, in order: the module that
#: blocks stop signals in it (first, so a job's SIGTERM cannot end it), then what every
#: worker imports (torch, Lightning's worker seeding: seconds per worker otherwise).
FORK_SERVER_PRELOAD = (
    "reprotrain.distributed._fork_server",
    "torch",
    "lightning.fabric.utilities.seed",
)


def worker_start(*parts: object) -> Any | None:
    """The ``multiprocessing_context`` for DataLoader workers in this process, or None (fork).

    Under a process group the process runs the backend's threads (gloo's, NCCL's), and a
    worker forked beside them can hang for good in a lock one of them held at the fork
    (twice in our CI: a rank of a 2-process gloo run waited 600 s for its first batch;
    pytorch/pytorch#130610 is the pin-memory thread's case). Workers then start from a
    fork server: a process started without those threads, which forks each worker and
    has imported :data:`FORK_SERVER_PRELOAD` and the modules of ``parts`` once.
    ``parts`` (the dataset, the collate function) travel to each worker pickled, which
    is checked here: where they cannot be pickled the workers fork as before, with a
    warning. The fork server blocks SIGTERM and SIGINT and its workers inherit that, so
    a signal to the whole job reaches the training processes alone; and the bits do not
    depend on how workers start (each is seeded by its ``worker_init_fn``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        ForkingPickler.dumps(parts)
    except (pickle.PicklingError, TypeError, AttributeError) as err:  # what pickling raises
        warnings.warn(
            f"DataLoader workers fork beside the process group's threads, which can hang a "
            f"worker, because the data cannot be pickled for a fork server ({err}); make it "
            "picklable, or set num_workers: 0",
            stacklevel=2,
        )
        return None
    modules = {getattr(part, "__module__", None) for part in parts if part is not None}
    context = multiprocessing.get_context("forkserver")
    extra = sorted(m for m in modules - {None, *FORK_SERVER_PRELOAD} if m != "builtins")
    context.set_forkserver_preload([*FORK_SERVER_PRELOAD, *extra])
    return context


class RankAgreement(Callback):
    """Fail closed unless every rank runs with the same ``facts`` (run ID, resume point...).

    Checked in ``setup``, once the process group is up and before any step:
    every rank gathers every rank's facts, so all of them stop together with
    the same message (:func:`~reprotrain.determinism.refuse_or_warn` decides,
    by ``mode``). ``ranks`` keeps the gathered table.
    """

    def __init__(self, facts: Mapping[str, Any], mode: Mode = True) -> None:
        self.facts = dict(facts)
        self.mode = mode
        self.ranks: list[dict[str, Any]] = [self.facts]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.ranks = gather_from_ranks(self.facts)
        reference = self.ranks[0]
        disagreements = [
            f"rank {rank} has {key}={facts.get(key)!r} (rank 0: {reference.get(key)!r})"
            for rank, facts in enumerate(self.ranks)
            for key in sorted(set(facts) | set(reference))
            if facts.get(key) != reference.get(key)
        ]
        if not disagreements:
            return
        message = (
            "ranks disagree on what they run: " + "; ".join(disagreements) + ". Every rank needs "
            "the same code, params, data and environment (several nodes: the same image, the data "
            "and the checkpoint folder on shared storage)"
        )
        refuse_or_warn(self.mode, message)
