"""TraceCallback and its fingerprints: stable, bit-sensitive, order-independent, byte-exact files.

Also home of the tiny Lightning set-up that test_compare and test_locate reuse:
``TinyNet`` (optionally with a layer that turns non-deterministic from a given
step on) and ``fit_traced``, one seeded, deterministic fit with a trace.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import struct
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler, TensorDataset

from reprotrain import fingerprint as fpmod
from reprotrain.determinism import configure_determinism
from reprotrain.fingerprint import (
    bytes_fingerprints,
    fingerprint,
    fingerprints,
    host_bytes,
    host_fingerprints,
    tensor_bytes,
)
from reprotrain.trace.callback import DEFAULT_WEIGHTS_EVERY, TraceCallback
from reprotrain.trace.diff import compare_traces
from reprotrain.trace.finalstate import final_fingerprints
from reprotrain.trace.rngstate import RngDigests, capture_rng, hash_bytes, rng_states
from reprotrain.trace.tracefile import FINAL_PARTS, RECORDS, load_trace
from tests.test_fingerprint import OTHER_KINDS, _made

STEPS_PER_EPOCH = 8
BATCH_SIZE = 8


# Noise that moves the loss far from a tie: at 1e-3 two runs' float32 losses at the noisy
# step were ~1e-4 apart (1.5e-5 at the closest of 15 pairs), and once, in CI, the same bits.
NOISE_SCALE = 0.1


def unseeded_generator() -> torch.Generator:
    """A generator no seed reaches: a stand-in for a non-deterministic kernel."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


class NoisyFromStep(nn.Module):
    """Identity until training step ``start``, then adds unseeded noise to its input."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start, self.calls = start, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        self.calls += 1
        if self.calls <= self.start:
            return x
        return x + NOISE_SCALE * torch.randn(x.shape, generator=unseeded_generator())


class _NoisyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad + NOISE_SCALE * torch.randn(grad.shape, generator=unseeded_generator())


class NoisyGradFromStep(NoisyFromStep):
    """Identity forward; from step ``start`` on its backward adds unseeded noise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return _NoisyBackward.apply(x) if self.calls > self.start else x


class TinyNet(L.LightningModule):
    """8 -> 16 -> 3 classifier with dropout; ``net.2`` is the slot for a noisy layer."""

    def __init__(self, middle: nn.Module | None = None, optimizer: type = torch.optim.SGD) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16),
            nn.ReLU(),
            middle if middle is not None else nn.Identity(),
            nn.Dropout(0.2),
            nn.Linear(16, 3),
        )
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters(), lr=0.1)


def tiny_data() -> TensorDataset:
    """Fixed data, independent of the run's seed."""
    gen = torch.Generator().manual_seed(1234)
    n = STEPS_PER_EPOCH * BATCH_SIZE
    return TensorDataset(torch.randn(n, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen))


class PrefixThenShuffle(Sampler[int]):
    """The first ``prefix`` indices in order, the rest shuffled by a generator seeded ``seed``."""

    def __init__(self, n: int, prefix: int, seed: int) -> None:
        self.n, self.prefix, self.seed = n, prefix, seed

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        rest = torch.randperm(
            self.n - self.prefix, generator=torch.Generator().manual_seed(self.seed)
        )
        yield from range(self.prefix)
        yield from (self.prefix + rest).tolist()


def fit_traced(
    path: Path,
    *,
    seed: int = 0,
    make_model: Callable[[], L.LightningModule] = TinyNet,
    sampler: Sampler[int] | None = None,
    epochs: int = 1,
    before: Sequence[L.Callback] = (),
    after: Sequence[L.Callback] = (),
    trace_class: type[TraceCallback] = TraceCallback,
    **trace_options: Any,
) -> Path:
    """One deterministic CPU fit of ``make_model()`` with a TraceCallback writing ``path``.

    ``before`` and ``after``: callbacks that run before and after the trace's.
    """
    saved_flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    settings = configure_determinism(seed, True)
    model = make_model()
    loader = DataLoader(
        tiny_data(),
        batch_size=BATCH_SIZE,
        shuffle=sampler is None,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed) if sampler is None else None,
        num_workers=0,
    )
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[*before, trace_class(path, **trace_options), *after],
        **settings.trainer_flags(),
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on workers and deprecations
            trainer.fit(model, loader)
    finally:
        torch.use_deterministic_algorithms(saved_flags[0], warn_only=saved_flags[1])
    return path


# -- fingerprints ----------------------------------------------------------------------


def test_same_bits_give_the_same_fingerprint() -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert int(fingerprint(t)) == int(fingerprint(t.clone())) == int(fingerprint(t.view(10, 100)))
    assert 0 <= int(fingerprint(t)) < 2**32


@pytest.mark.parametrize("position", [0, 517, 999])
def test_one_flipped_bit_changes_the_fingerprint(position: int) -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    nudged = t.clone()
    nudged[position] = torch.nextafter(t[position], torch.tensor(float("inf")))
    assert int(fingerprint(nudged)) != int(fingerprint(t))
    zeros = torch.zeros(4)
    assert int(fingerprint(-zeros)) != int(fingerprint(zeros))  # -0.0 is other bits


def test_fingerprint_is_position_dependent() -> None:
    t = torch.arange(10, dtype=torch.float32)
    swapped = t[[1, 0, *range(2, 10)]]
    assert int(fingerprint(swapped)) != int(fingerprint(t))
    # Negative control: a plain sum of the same bytes cannot see the swap.
    assert int(tensor_bytes(swapped).sum()) == int(tensor_bytes(t).sum())


# On CPU: numpy on the host, batched (100) and alone (100_003), and the int8 matmul (300_003).
@pytest.mark.parametrize("numel", [100, 100_003, 300_003])
def test_fingerprint_does_not_depend_on_reduction_order(numel: int) -> None:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    whole = int(fingerprint(t))
    # The fingerprint is a sum over bytes: add up each chunk's share, in a shuffled order.
    size = -(-numel // 23)
    starts = list(range(0, numel, size))
    random.Random(0).shuffle(starts)
    total = 0
    for start in starts:
        only_chunk = torch.zeros_like(t)
        only_chunk[start : start + size] = t[start : start + size]
        total = (total + int(fingerprint(only_chunk))) % 2**32
    assert total == whole
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert int(fingerprint(t)) == whole
    finally:
        torch.set_num_threads(threads)


def test_rng_state_follows_each_generator() -> None:
    before = rng_states()
    random.random()
    after_python = rng_states()
    np.random.rand()
    after_numpy = rng_states()
    torch.rand(1)
    after_torch = rng_states()
    changed = [
        {k for k in before if x[k] != y[k]}
        for x, y in (
            (before, after_python),
            (after_python, after_numpy),
            (after_numpy, after_torch),
        )
    ]
    assert changed == [{"python"}, {"numpy"}, {"torch"}]
    assert rng_states() == after_torch  # reading the states consumes nothing


@pytest.mark.parametrize("numel", [0, 1, 1000, 16_384, 16_385, 262_144, 262_145])
def test_the_host_gives_the_fingerprints_of_the_torch_kernels(numel: int) -> None:
    # CPU tensors up to 1 MiB are fingerprinted with numpy: the torch kernels, which
    # other devices run, must give the same values (16_384 floats: 64 KiB; 262_144: 1 MiB).
    gen = torch.Generator().manual_seed(numel)
    tensors = [
        torch.randn(numel, generator=gen),
        torch.randint(-128, 128, (numel,), generator=gen, dtype=torch.int8),
        torch.rand(numel, generator=gen) > 0.5,
    ]
    data = [tensor_bytes(t) for t in tensors]
    with fpmod._one_thread():
        kernels = [int(fpmod._large(d)) & 0xFFFFFFFF for d in data]
        if all(d.numel() <= fpmod._SMALL_BYTES for d in data):
            assert (fpmod._small(data, torch.device("cpu")) & 0xFFFFFFFF).tolist() == kernels
    assert host_fingerprints(tensors) == kernels
    if numel <= 262_144:
        assert bytes_fingerprints([host_bytes(t) for t in tensors]) == kernels
    else:
        with pytest.raises(ValueError, match="at most 1048576 bytes"):
            bytes_fingerprints([host_bytes(t) for t in tensors])
    assert fingerprints(tensors, torch.device("cpu")).tolist() == kernels


def test_rng_digests_are_blake2b_of_the_rng_states() -> None:
    captures = []
    for step in range(5):
        if step in (2, 3):
            random.random()
        np.random.rand()
        torch.rand(1)
        captures.append(capture_rng(captures[-1] if captures else None))
    digests = RngDigests(("python", "numpy", "torch", "cuda:0"))
    for captured in captures:
        states = rng_states(captured)
        joined = b"".join(name.encode() + b"\0" + state for name, state in states.items())
        combined = hashlib.blake2b(joined, digest_size=8).digest()
        own = [hash_bytes(states[name]) for name in ("python", "numpy", "torch")]
        assert digests(captured) == [int.from_bytes(combined, "little", signed=True), *own, 0]
    # An unchanged python state is kept once; a changed one is not taken for the old one.
    python = [captured[0] for captured in captures]  # drawn from before steps 2 and 3
    assert [python[i] is python[i - 1] for i in range(1, 5)] == [True, False, False, True]
    assert len({hash_bytes(rng_states(c)["python"]) for c in captures}) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("numel", [100, 100_003, 300_003])
def test_fingerprint_is_the_same_on_cuda_and_cpu(numel: int) -> None:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    assert int(fingerprint(t.cuda())) == int(fingerprint(t))


class DevicePathTrace(TraceCallback):
    """A TraceCallback that builds its rows as on a GPU (copies kept, fingerprinted at a flush)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._on_cpu = self._batches._on_cpu = False  # the rows and the batch column


@pytest.mark.parametrize("detail", ["default", "full"])
def test_rows_built_as_on_a_gpu_are_the_same_bytes(tmp_path: Path, detail: str) -> None:
    """The GPU's deferred rows (batches fingerprinted together at each flush) give the file
    that fingerprinting each batch at its step gives; a different seed is the control."""
    cpu = fit_traced(tmp_path / "cpu.safetensors", detail=detail)
    as_gpu = tmp_path / "gpu.safetensors"
    fit_traced(
        as_gpu, before=(), after=(), detail=detail, flush_every=3, trace_class=DevicePathTrace
    )
    assert as_gpu.read_bytes() == cpu.read_bytes()
    other = fit_traced(
        tmp_path / "seed1.safetensors", seed=1, detail=detail, trace_class=DevicePathTrace
    )
    assert other.read_bytes() != cpu.read_bytes()


def test_row_fingerprints_equal_each_tensors_fingerprint() -> None:
    gen = torch.Generator().manual_seed(3)
    for shapes in ([(64, 1024), (64,)], [(3,), (0,), (70_000,)], [(262_144,)]):
        batches = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
        data = torch.stack([torch.cat([tensor_bytes(t) for t in b]) for b in batches])
        sizes = [t.nbytes for t in batches[0]]
        expected = torch.stack([fpmod.fingerprints(b, torch.device("cpu")) for b in batches])
        assert torch.equal(fpmod.row_fingerprints(data, sizes), expected)
    flipped = data.clone()
    flipped[1, 5] ^= 1
    assert not torch.equal(fpmod.row_fingerprints(flipped, sizes), expected)


class SyncWatchedTrace(TraceCallback):
    """A TraceCallback whose hooks from the second step on run under torch's CUDA sync debug
    mode ("warn"); the first step makes the per-layout constants (a copy to the device each)."""

    def _watched(self, watch: bool, hook: Callable[..., None], *args: Any) -> None:
        torch.cuda.set_sync_debug_mode("warn" if watch else "default")
        try:
            hook(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def on_train_batch_start(self, *args: Any) -> None:
        self._watched(len(self._host) >= 1, super().on_train_batch_start, *args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._watched(len(self._host) >= 2, super().on_before_optimizer_step, *args)

    def on_train_batch_end(self, *args: Any) -> None:
        self._watched(len(self._host) >= 2, super().on_train_batch_end, *args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_trace_never_synchronises_the_gpu_within_a_step(tmp_path: Path) -> None:
    """Rows stay on the device until a flush: no hook of a step waits for the GPU.

    Weights rows included (step 32 of 40); the flush is past the fit's end.
    """
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40 * BATCH_SIZE, 8, generator=gen), torch.zeros(320).long())
    trace = SyncWatchedTrace(tmp_path / "t.safetensors", flush_every=1000)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[trace],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyNet(), DataLoader(data, batch_size=BATCH_SIZE))
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if _is_sync(w)]
    assert not syncs, "\n".join(syncs)
    assert load_trace(tmp_path / "t.safetensors").num_steps == 40
    # The control: the same watch sees a read of a device value.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace._watched(True, lambda: torch.ones(1, device="cuda").item())
    assert any(_is_sync(w) for w in caught)


def _is_sync(warning: warnings.WarningMessage) -> bool:
    return "called a synchronizing CUDA operation" in str(warning.message)


# -- the callback and its file ---------------------------------------------------------


@pytest.fixture(scope="module")
def same_seed_runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    work = tmp_path_factory.mktemp("trace")
    return [
        fit_traced(work / "a.safetensors"),
        fit_traced(work / "b.safetensors"),
        fit_traced(work / "c.safetensors", flush_every=3),
        fit_traced(work / "full.safetensors", detail="full"),
    ]


def test_same_seed_gives_byte_identical_traces(same_seed_runs: list[Path]) -> None:
    a, b, _, _ = same_seed_runs
    assert a.read_bytes() == b.read_bytes()
    trace = load_trace(a)
    assert trace.num_steps == STEPS_PER_EPOCH
    assert trace.step.tolist() == list(range(STEPS_PER_EPOCH))
    assert set(trace.records) == set(RECORDS)
    assert np.isfinite(trace.loss_value).all()
    rows = np.arange(STEPS_PER_EPOCH)
    assert np.array_equal(trace.weights_traced, rows % DEFAULT_WEIGHTS_EVERY == 0)
    assert (trace.records["params"][~trace.weights_traced] == 0).all()
    assert compare_traces(trace, load_trace(b)).identical
    assert trace.backward_losses is None  # a column of manual optimization only


def test_flushing_more_often_writes_the_same_bytes(same_seed_runs: list[Path]) -> None:
    a, _, flushed_every_3, _ = same_seed_runs
    assert a.read_bytes() == flushed_every_3.read_bytes()


def test_full_detail_adds_per_tensor_columns_without_changing_the_rest(
    same_seed_runs: list[Path],
) -> None:
    default, full = load_trace(same_seed_runs[0]), load_trace(same_seed_runs[3])
    names = tuple(name for name, _ in TinyNet().named_parameters())
    assert full.detail == "full" and full.param_names == names and full.weights_traced.all()
    assert full.grads_per_param is not None and full.params_per_param is not None
    assert full.grads_per_param.shape == full.params_per_param.shape == (8, len(names))
    assert full.rng_per_source is not None and full.rng_per_source.shape == (8, 3)
    assert default.grads_per_param is None
    assert compare_traces(default, full).identical


class ZeroTheBatch(L.Callback):
    """Zeroes every training batch in place, at the start or at the end of its step."""

    def __init__(self, at_start: bool) -> None:
        self.at_start = at_start

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, _: int) -> None:
        if self.at_start:
            batch[0].zero_()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: Any, _: Any, batch: Any, i: int
    ) -> None:
        if not self.at_start:
            batch[0].zero_()


def test_a_batch_changed_after_its_step_is_traced_as_it_came(
    same_seed_runs: list[Path], tmp_path: Path
) -> None:
    # The trace keeps a copy of a small CPU batch's bytes and fingerprints it later.
    plain = load_trace(same_seed_runs[0])
    after = fit_traced(tmp_path / "after.safetensors", after=[ZeroTheBatch(at_start=False)])
    assert after.read_bytes() == same_seed_runs[0].read_bytes()
    # Negative control: zeroed before the trace reads it, the batch column shows it.
    before = load_trace(
        fit_traced(tmp_path / "before.safetensors", before=[ZeroTheBatch(at_start=True)])
    )
    assert (before.records["batch"] != plain.records["batch"]).all()


def test_load_trace_refuses_a_file_that_is_not_a_trace(tmp_path: Path) -> None:
    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match="not a reprotrain trace"):
        load_trace(other)


def test_trace_callback_rejects_unknown_detail(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="detail"):
        TraceCallback(tmp_path / "t.safetensors", detail="everything")  # type: ignore[arg-type]


def test_rng_captures_read_in_place_are_the_libraries_own_states() -> None:
    """capture_rng reads the generators' structs; every state equals getstate / get_state."""
    draws = {
        "nothing": lambda: None,
        "uniform": np.random.rand,
        "gaussian cached": np.random.standard_normal,
        "cached gaussian used": np.random.standard_normal,
        "reseeded": lambda: np.random.seed(7),
        "python gauss": lambda: random.gauss(0, 1),
        "python reseeded": lambda: random.seed(3),
    }
    previous = capture_rng()
    for what, draw in draws.items():
        draw()
        captured = capture_rng(previous)
        assert captured[0] == random.getstate(), what
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        ours = captured[1]
        assert ours[0] == kind and np.array_equal(ours[1], keys), what
        assert ours[2:4] == (pos, has_gauss), what
        assert struct.pack("d", ours[4]) == struct.pack("d", cached), what
        # the negative control: a draw is never taken for the state before it
        moved = what not in ("nothing", "python gauss", "python reseeded")
        assert (ours is not previous[1]) == moved, what
        previous = captured
    assert previous[0][2] is None  # random.seed clears the cached python gaussian


def test_rng_captures_fall_back_to_the_libraries_where_a_layout_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from reprotrain.trace import rngstate

    monkeypatch.setattr(rngstate, "_gauss_offset", lambda: None)
    monkeypatch.setattr(rngstate, "_python_layout_known", lambda generator: False)
    np.random.standard_normal()
    captured = capture_rng()
    assert captured[0] == random.getstate()
    assert rng_states(captured)["numpy"] == rng_states(capture_rng())["numpy"]
    assert captured[1][3] == np.random.get_state(legacy=True)[3] == 1


# -- sparse tensors and manual optimization ---------------------------------------------


class SparseAdjacency(TinyNet):
    """TinyNet behind a graph adjacency kept as a sparse buffer (a GCN's ``adj``)."""

    def __init__(self, neighbour: float = 1.0) -> None:
        super().__init__()
        ring = torch.eye(BATCH_SIZE) + neighbour * torch.diag(torch.ones(BATCH_SIZE - 1), 1)
        self.register_buffer("adj", ring.to_sparse())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.sparse.mm(self.adj, x))


def test_a_model_with_a_sparse_buffer_is_traced_to_the_end(tmp_path: Path) -> None:
    """The final state covers the sparse buffer: another neighbour weight is another state."""
    a, b = (load_trace(fit_traced(tmp_path / f"{n}.safetensors", make_model=SparseAdjacency))
            for n in "ab")  # fmt: skip
    buffers = FINAL_PARTS.index("buffers")
    assert compare_traces(a, b).identical and a.final_state[0][buffers] != 0
    other = fit_traced(tmp_path / "c.safetensors", make_model=lambda: SparseAdjacency(0.5))
    assert load_trace(other).final_state[0][buffers] != a.final_state[0][buffers]


class SparseBatches(TinyNet):
    """TinyNet whose batches arrive with sparse inputs; from batch ``change_from`` one
    input value is another."""

    def __init__(self, change_from: int | None = None) -> None:
        super().__init__()
        self.change_from, self.batches = change_from, 0

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        if self.change_from is not None and self.batches >= self.change_from:
            x = x.clone()
            x[0, 0] += 1.0
        self.batches += 1
        return x.to_sparse(), y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to_dense())


def test_sparse_batches_are_traced_from_their_parts(tmp_path: Path) -> None:
    cpu = fit_traced(tmp_path / "cpu.safetensors", make_model=SparseBatches)
    as_gpu = fit_traced(
        tmp_path / "gpu.safetensors", make_model=SparseBatches, trace_class=DevicePathTrace
    )
    assert as_gpu.read_bytes() == cpu.read_bytes()
    changed = fit_traced(tmp_path / "changed.safetensors", make_model=lambda: SparseBatches(3))
    diff = compare_traces(load_trace(cpu), load_trace(changed))
    assert (diff.first_row, diff.record) == (3, "batch")


class TwoOptimizers(L.LightningModule):
    """Manual optimization as Lightning's docs write it: two optimizers, a manual_backward
    for each, and a training_step that returns nothing. From batch ``fault_at`` on, loss
    number ``fault_in`` is scaled by unseeded noise (so are its gradients)."""

    def __init__(self, fault_at: int | None = None, fault_in: int = 0) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.fault_at, self.fault_in = fault_at, fault_in
        second = nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 3))  # draws random numbers
        self.heads = nn.ModuleList([nn.Linear(8, 3), second])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        for index, (head, optimizer) in enumerate(zip(self.heads, self.optimizers(), strict=True)):
            loss = F.cross_entropy(head(x), y)
            if index == self.fault_in and self.fault_at is not None and batch_idx >= self.fault_at:
                loss = loss * (1 + NOISE_SCALE * torch.rand((), generator=unseeded_generator()))
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(head.parameters(), lr=0.1) for head in self.heads]


class FirstBackwardLoss(L.Callback):
    """The first loss each batch gives backward, as a float."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_start(self, *_: Any) -> None:
        self.first = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.first:
            self.losses.append(loss.item())
            self.first = False


@pytest.fixture(scope="module")
def manual_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[float]]:
    work, seen = tmp_path_factory.mktemp("manual"), FirstBackwardLoss()
    a = fit_traced(work / "a.safetensors", make_model=TwoOptimizers, after=(seen,))
    return a, fit_traced(work / "b.safetensors", make_model=TwoOptimizers), seen.losses


def test_manual_optimization_records_its_backward_losses(
    tmp_path: Path, manual_runs: tuple[Path, Path, list[float]]
) -> None:
    """The loss is the first backward loss; all of them are one more column, the same
    bytes when the rows are built as on a GPU."""
    a, b, first_losses = manual_runs
    assert a.read_bytes() == b.read_bytes()
    as_gpu = fit_traced(
        tmp_path / "gpu.safetensors", make_model=TwoOptimizers, trace_class=DevicePathTrace,
        flush_every=3,
    )  # fmt: skip
    assert as_gpu.read_bytes() == a.read_bytes()
    trace = load_trace(a)
    assert trace.loss_value.tolist() == first_losses and np.isfinite(first_losses).all()
    assert trace.backward_losses is not None and len(set(trace.backward_losses)) == len(trace.step)


@pytest.mark.parametrize("fault_in", [0, 1], ids=["first loss", "second loss"])
def test_manual_optimization_finds_a_fault_at_its_step(
    tmp_path: Path, manual_runs: tuple[Path, Path, list[float]], fault_in: int
) -> None:
    faulty = fit_traced(tmp_path / "f.safetensors", make_model=lambda: TwoOptimizers(3, fault_in))
    diff = compare_traces(load_trace(manual_runs[0]), load_trace(faulty))
    assert (diff.first_row, diff.record) == (3, "loss")


def test_the_final_state_reads_sparse_quantized_and_nested_buffers() -> None:
    def state(scale: float) -> dict[str, dict[str, torch.Tensor]]:
        buffers = {kind: _made(kind, scale) for kind in OTHER_KINDS}
        return {"parameters": {"w": torch.ones(2)}, "buffers": buffers, "optimizer": {}}

    fingerprints_of = final_fingerprints(state(2.0))
    assert final_fingerprints(state(2.0)) == fingerprints_of
    assert final_fingerprints(state(3.0))[1] != fingerprints_of[1]  # the buffers part
