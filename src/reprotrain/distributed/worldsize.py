"""Training whose bits do not depend on the world size, on Lightning's DDP.

Plain DDP gives the same bits only for a fixed world size: each rank's share
of the data, each rank's random stream and the order in which the all-reduce
adds gradients all follow the number of processes. In this mode the world
size decides none of them, so 1, 2, 4 (any power of two that divides the
number of micro-batches) processes train to identical weights::

    from reprotrain.distributed.microbatches import MicroBatchSampler
    from reprotrain.distributed.worldsize import WorldSizeInvariantStrategy

    strategy = WorldSizeInvariantStrategy(micro_batches=4, seed=seed, accelerator="cpu")
    trainer = L.Trainer(strategy=strategy, devices=devices, num_nodes=nodes,
                        accumulate_grad_batches=strategy.micro_batches_per_rank(devices * nodes),
                        use_distributed_sampler=False, ...)
    loader = DataLoader(data, batch_sampler=MicroBatchSampler(len(data), 64, 16, rank,
                        world_size, generator), ...)

How: every global batch is ``micro_batches`` micro-batches cut from one
permutation that every rank draws alike
(:class:`~reprotrain.distributed.microbatches.MicroBatchSampler`); rank
``r`` of ``W`` runs micro-batches ``r*k .. r*k+k-1`` (``k = micro_batches /
W``) as Lightning's gradient accumulation. Before each micro-batch the
python, numpy and torch generators (CPU and CUDA) are seeded from (seed,
optimizer step, micro-batch id), and a dataset's per-sample draws take their
key from the sampler (:mod:`reprotrain.distributed.microbatches`), so no
draw depends on the rank or a DataLoader worker. A rank's earlier
micro-batches run under DDP's ``no_sync`` and their gradients are kept
apart (each backward starts from no gradient, so nothing is added outside
the tree). In the last one's
backward, DDP's all-reduce is replaced by a communication hook that, per
gradient bucket as soon as it is ready, adds the rank's micro-batch
gradients by :func:`tree_sum` (one fixed binary tree over micro-batch ids:
the rank's subtree), then adds the ranks' subtree sums by the top of the
same tree: at span 1, 2, 4... each rank swaps its sum with rank ``rank ^
span`` and adds (``a + b`` and ``b + a`` are the same bits), so every rank
ends with the whole tree's sum. The additions are those of one process
doing it all, so the gradient, hence the optimizer step, is the same bits
at any world size. :func:`step_loss` is the mean loss over all
micro-batches, by the same tree.

Limits: the last partial global batch of an epoch is dropped (every step has
all its micro-batches); batch norm sees per-micro-batch statistics and its
running statistics would be rank 0's, so modules that track them are refused;
precision plugins that scale the loss (``16-mixed``) are untested. The cost:
micro-batches are smaller kernels than one batch per rank, each rank
sends and receives ``log2(world_size)`` gradients where a ring all-reduce
moves about two, and gloo's send and receive have no future, so the hook
blocks the backward while a bucket is exchanged (no overlap with it)
(``benchmarks/overhead/invariant_overhead.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage
from torch import nn

from reprotrain.distributed.ddp import BACKENDS, DDP_OPTIONS
from reprotrain.distributed.microbatches import invariant_layout_problem, micro_batch_seed
from reprotrain.seeding import seed_all

__all__ = ["WorldSizeInvariantStrategy", "refuse_tracked_batch_norm", "step_loss", "tree_sum"]


def tree_sum(leaves: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum by halving: ``sum(lo, hi) = sum(lo, mid) + sum(mid, hi)``, ``mid = lo + (hi-lo)//2``.

    With ``W`` (a power of two) dividing ``len(leaves)``, the tree's nodes
    include the ``W`` contiguous equal ranges, so summing each range first
    and then the range sums gives the same additions, bit for bit.
    """

    def node(lo: int, hi: int) -> torch.Tensor:
        if hi - lo == 1:
            return leaves[lo]
        mid = lo + (hi - lo) // 2
        return node(lo, mid) + node(mid, hi)

    if not leaves:
        raise ValueError("tree_sum of nothing")
    if len(leaves) == 1:
        return leaves[0] if out is None else out.copy_(leaves[0])
    mid = len(leaves) // 2
    # The top addition may write into one of its own leaves (out is a leaf): same bits.
    return torch.add(node(0, mid), node(mid, len(leaves)), out=out)


def _tree_reduce_hook(strategy, bucket):  # type: ignore[no-untyped-def]
    """DDP's communication hook in this mode: the bucket's mean gradient by the fixed tree.

    No annotations: DDP checks them against its classes, and here they would be strings.
    """
    buffer = bucket.buffer()
    strategy.add_local_subtree(bucket.parameters(), buffer)
    return strategy.combine_ranks(buffer, bucket.index())


def refuse_tracked_batch_norm(module: nn.Module) -> str | None:
    """Why ``module`` cannot train world-size invariant, or None: batch norm layers that
    track running statistics (every rank would keep its own; the model saves rank 0's)."""
    tracked = [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
    ]
    if not tracked:
        return None
    return (
        f"{', '.join(tracked)}: batch norm with running statistics is not world-size invariant "
        "(they would be rank 0's); use track_running_stats=False or GroupNorm, or set "
        "train.world_size_invariant: false"
    )


class WorldSizeInvariantStrategy(DDPStrategy):
    """Lightning's DDP with micro-batch gradients added in one fixed tree (see the module doc).

    ``micro_batches`` is the number of micro-batches per optimizer step over
    all ranks; the Trainer's ``accumulate_grad_batches`` must be
    :meth:`micro_batches_per_rank` of the world size (checked at setup).
    After each step's backward, ``step_loss`` is the mean loss over all
    micro-batches and ``micro_batch_loss`` this rank's latest micro-batch's.
    """

    def __init__(self, micro_batches: int, seed: int, accelerator: str = "cpu") -> None:
        super().__init__(process_group_backend=BACKENDS[accelerator], **DDP_OPTIONS)
        self.micro_batches = micro_batches
        self.seed = seed
        self.step_loss: torch.Tensor | None = None
        self.micro_batch_loss: torch.Tensor | None = None
        # This step's earlier micro-batches on this rank: their gradients, by parameter.
        self._kept: list[dict[torch.Tensor, torch.Tensor]] = []
        self._losses: list[torch.Tensor] = []
        # Receive buffers by bucket, kept across steps: a fresh one costs its page faults
        # every step (an exchange of 40 MB at 2 gloo ranks here: 80 ms fresh, 35 ms reused).
        self._received: dict[int, torch.Tensor] = {}

    def _register_ddp_hooks(self) -> None:
        # Lightning registers a comm hook on CUDA only; torch's DDP takes one on gloo too.
        self.model.register_comm_hook(self, _tree_reduce_hook)

    def micro_batches_per_rank(self, world_size: int) -> int:
        problem = invariant_layout_problem(self.micro_batches, 1, world_size)
        if problem:
            raise ValueError(problem)
        return self.micro_batches // world_size

    @property
    def first_micro_batch(self) -> int:
        """Micro-batch id of this rank's first micro-batch in each step."""
        return self.global_rank * (self.micro_batches // self.world_size)

    def setup(self, trainer: Any) -> None:
        expected = self.micro_batches_per_rank(self.world_size)
        if trainer.accumulate_grad_batches != expected:
            raise ValueError(
                f"accumulate_grad_batches is {trainer.accumulate_grad_batches}; world-size "
                f"invariant training of {self.micro_batches} micro-batches on {self.world_size} "
                f"ranks needs {expected}"
            )
        if problem := refuse_tracked_batch_norm(trainer.lightning_module):
            raise ValueError(problem)
        super().setup(trainer)

    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        # Lightning moves a training batch here just before on_train_batch_start, so every
        # callback (a trace of the RNG state) already sees the micro-batch's own seed.
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            micro_batch = self.first_micro_batch + len(self._losses)
            seed_all(micro_batch_seed(self.seed, trainer.global_step, micro_batch))
        return super().batch_to_device(batch, device, dataloader_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        loss = output.get("loss") if isinstance(output, dict) else output
        if isinstance(loss, torch.Tensor):
            self.micro_batch_loss = loss.detach().clone()
        return output

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        # Lightning divides the loss by accumulate_grad_batches, which follows the world
        # size. Multiplying it back in the graph sends exactly 1.0 into the loss's backward
        # (k * 1 / k is exact for the one scalar), so each micro-batch's gradient is its own.
        k = self.lightning_module.trainer.accumulate_grad_batches
        return super().backward(closure_loss * k, optimizer, *args, **kwargs)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self._losses.append(
            self.micro_batch_loss if self.micro_batch_loss is not None else torch.zeros(())
        )
        if len(self._losses) < self.lightning_module.trainer.accumulate_grad_batches:
            # An earlier micro-batch (DDP did not sync): keep its gradients for the hook, and
            # let the next backward start from none, so no addition happens outside the tree.
            params = self._params()
            self._kept.append(
                {p: p.grad if p.grad is not None else torch.zeros_like(p) for p in params}
            )
            for p in params:
                p.grad = None

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        def closure_then_mean_loss() -> Any:
            result = closure()
            self._kept = []
            self.step_loss = self._mean_loss()
            return result

        return super().optimizer_step(optimizer, closure_then_mean_loss, model, **kwargs)

    def add_local_subtree(self, params: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Replace the last micro-batch's gradients in ``buffer`` by this rank's subtree sum.

        ``buffer`` is a DDP bucket: the gradients of ``params``, flat, in that order.
        """
        if not self._kept:
            return
        offset = 0
        for p in params:
            view = buffer[offset : offset + p.numel()].view_as(p)
            tree_sum([kept[p] for kept in self._kept] + [view], out=view)
            offset += p.numel()

    def combine_ranks(self, local: torch.Tensor, bucket: int) -> torch.futures.Future:
        """A future of the mean gradient: the ranks' subtree sums added by the top of the tree."""
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(self._add_ranks(local, bucket).div_(self.micro_batches))
        return done

    def _add_ranks(self, local: torch.Tensor, key: int) -> torch.Tensor:
        """Turn this rank's subtree sum into the whole tree's, in place, by pairwise exchange.

        At span 1, 2, 4... each rank swaps its sum with rank ``rank ^ span`` and
        adds: both hold the sum of their block of ``2 * span`` ranks, the two
        halves' sums added (the tree's node: ``a + b`` and ``b + a`` are the same
        bits). Each rank moves ``log2(world_size)`` copies, all adds are torch's.
        gloo's send and receive have no future, so this blocks the backward.
        """
        if self.world_size == 1:
            return local
        theirs = self._received.get(key)
        if theirs is None or theirs.shape != local.shape or theirs.dtype != local.dtype:
            theirs = self._received[key] = torch.empty_like(local)
        span = 1
        while span < self.world_size:
            peer = self.global_rank ^ span
            sent = dist.isend(local, peer)
            dist.recv(theirs, peer)
            sent.wait()
            local.add_(theirs)
            span *= 2
        return local

    def _mean_loss(self) -> torch.Tensor:
        """The mean of all micro-batches' losses of the step, by the same tree."""
        local = tree_sum(self._losses).clone()
        self._losses = []
        return self._add_ranks(local, -1) / self.micro_batches

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]


def step_loss(trainer: Any) -> torch.Tensor | None:
    """The latest optimizer step's loss in this mode, or ``None`` outside it.

    The mean of all micro-batches' losses (every rank's), added by the tree:
    the same bits at any world size. Set once the step's last backward ran
    (``on_before_optimizer_step`` and later).
    """
    strategy = trainer.strategy
    return strategy.step_loss if isinstance(strategy, WorldSizeInvariantStrategy) else None
