"""A catalog of torch operations with non-deterministic default paths, to probe.

Each :class:`~reprotrain.ops.probes.OpCase` builds seeded inputs on a
device and returns a call that runs the op (for backward entries: the
gradient, which is where the atomic adds are). The list follows PyTorch's
``use_deterministic_algorithms`` documentation and the ops users trip over:
scatter / index / histogram kernels, several backward passes, and ops torch
refuses outright under determinism. Sizes are modest so the whole catalog
probes in seconds on a CPU; collisions (many values into 512 slots) are
dense so atomics race where a device uses them.

Nothing here says what an op *does*: :func:`reprotrain.ops.probes.probe_op`
measures that on the device at hand.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from reprotrain.ops.probes import Builder, OpCase, Thunk


def _grad_of(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Thunk:
    """The gradient of ``sum(fn(x) * w)`` w.r.t. ``x``: runs the op's backward kernel."""

    def call() -> tuple[torch.Tensor, ...]:
        leaf = x.detach().requires_grad_()
        out = fn(leaf)
        weight = torch.linspace(0.5, 1.5, out.numel(), device=out.device).view_as(out)
        (grad,) = torch.autograd.grad((out * weight).sum(), leaf)
        return (grad,)

    return call


def _randn(g: torch.Generator, dev: torch.device, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dev)


def _index(g: torch.Generator, dev: torch.device, high: int, n: int) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=g).to(dev)


def _scatter_like(method: str, **kw: Any) -> Builder:
    def build(dev: torch.device, g: torch.Generator) -> Thunk:
        src, idx = _randn(g, dev, 200_000), _index(g, dev, 512, 200_000)
        return lambda: (getattr(torch.zeros(512, device=dev), method)(0, idx, src, **kw),)

    return build


def _reduce(method: str, reduce: str) -> Builder:
    def build(dev: torch.device, g: torch.Generator) -> Thunk:
        src, idx = 1 + 1e-3 * _randn(g, dev, 100_000), _index(g, dev, 512, 100_000)

        def call() -> tuple[torch.Tensor, ...]:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")
                return (getattr(torch.ones(512, device=dev), method)(0, idx, src, reduce),)

        return call

    return build


def _put(accumulate: bool) -> Builder:
    def build(dev: torch.device, g: torch.Generator) -> Thunk:
        src, idx = _randn(g, dev, 200_000), _index(g, dev, 512, 200_000)
        return lambda: (torch.zeros(512, device=dev).put_(idx, src, accumulate=accumulate),)

    return build


def _index_put(dev: torch.device, g: torch.Generator) -> Thunk:
    src, idx = _randn(g, dev, 200_000), _index(g, dev, 512, 200_000)
    return lambda: (torch.zeros(512, device=dev).index_put_((idx,), src, accumulate=True),)


def _unary(fn: Callable[[torch.Tensor], Any], *shape: int) -> Builder:
    def build(dev: torch.device, g: torch.Generator) -> Thunk:
        x = _randn(g, dev, *shape)
        return lambda: tuple(torch.as_tensor(t) for t in _flat(fn(x)))

    return build


def _flat(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _backward(fn: Callable[[torch.Tensor], torch.Tensor], *shape: int) -> Builder:
    return lambda dev, g: _grad_of(fn, _randn(g, dev, *shape))


def _bincount(dev: torch.device, g: torch.Generator) -> Thunk:
    idx, weights = _index(g, dev, 512, 200_000), _randn(g, dev, 200_000)
    return lambda: (torch.bincount(idx, weights=weights, minlength=512),)


def _ctc(dev: torch.device, g: torch.Generator) -> Thunk:
    targets = torch.randint(1, 20, (16, 30), generator=g).to(dev)
    lengths = (torch.full((16,), 100, device=dev), torch.full((16,), 30, device=dev))
    return _grad_of(
        lambda x: F.ctc_loss(x.log_softmax(2), targets, *lengths, reduction="sum"),
        _randn(g, dev, 100, 16, 20),
    )


def _embedding_bag(dev: torch.device, g: torch.Generator) -> Thunk:
    idx, offsets = _index(g, dev, 64, 50_000), torch.arange(0, 50_000, 50, device=dev)
    return _grad_of(lambda w: F.embedding_bag(idx, w, offsets, mode="sum"), _randn(g, dev, 64, 32))


def _nll_loss2d(dev: torch.device, g: torch.Generator) -> Thunk:
    x = _randn(g, dev, 8, 10, 64, 64).log_softmax(1)
    target = torch.randint(0, 10, (8, 64, 64), generator=g).to(dev)
    return lambda: (F.nll_loss(x, target, reduction="sum"),)


def _grid_sample(dev: torch.device, g: torch.Generator) -> Thunk:
    grid = _randn(g, dev, 4, 64, 64, 2).clamp(-1, 1)
    return _grad_of(
        lambda x: F.grid_sample(x, grid, align_corners=False), _randn(g, dev, 4, 8, 32, 32)
    )


def _sdpa(dev: torch.device, g: torch.Generator) -> Thunk:
    k, v = _randn(g, dev, 4, 8, 128, 64), _randn(g, dev, 4, 8, 128, 64)
    return _grad_of(
        lambda q: F.scaled_dot_product_attention(q, k, v), _randn(g, dev, 4, 8, 128, 64)
    )


def _unpool(dim: int) -> Builder:
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dim - 1]
    unpool = (F.max_unpool1d, F.max_unpool2d, F.max_unpool3d)[dim - 1]

    def build(dev: torch.device, g: torch.Generator) -> Thunk:
        out, indices = pool(_randn(g, dev, 4, 8, *(16,) * dim), 2, return_indices=True)
        return lambda: (unpool(out, indices, 2),)

    return build


def _fractional(dev: torch.device, g: torch.Generator) -> Thunk:
    samples = torch.rand(4, 8, 2, generator=g).to(dev)  # fixed, so only the kernel varies
    return _grad_of(
        lambda x: F.fractional_max_pool2d(x, 2, output_size=20, _random_samples=samples),
        _randn(g, dev, 4, 8, 32, 32),
    )


def _interpolate(mode: str, dims: int) -> Builder:
    shape = (4, 8, *(16,) * dims) if dims < 3 else (2, 4, 8, 8, 8)
    corners = None if mode == "nearest" else False
    return _backward(
        lambda x: F.interpolate(x, scale_factor=2, mode=mode, align_corners=corners), *shape
    )


CATALOG: tuple[OpCase, ...] = (
    OpCase("Tensor.scatter_add_", _scatter_like("scatter_add_")),
    OpCase("Tensor.index_add_", _scatter_like("index_add_")),
    OpCase("Tensor.scatter_ (duplicate indices)", _scatter_like("scatter_")),
    OpCase("Tensor.scatter_reduce_ sum", _reduce("scatter_reduce_", "sum")),
    OpCase("Tensor.scatter_reduce_ prod", _reduce("scatter_reduce_", "prod")),
    OpCase("Tensor.index_reduce_ prod", _reduce("index_reduce_", "prod")),
    OpCase("Tensor.index_put_ accumulate=True", _index_put),
    OpCase("Tensor.put_ accumulate=True", _put(True)),
    OpCase("Tensor.put_ accumulate=False", _put(False)),
    OpCase("bincount with weights", _bincount),
    OpCase("histc", _unary(lambda x: torch.histc(x, bins=100), 200_000)),
    OpCase("cumsum (float)", _unary(lambda x: torch.cumsum(x, 0), 200_000)),
    OpCase("kthvalue", _unary(lambda x: torch.kthvalue(x, 7, dim=1), 256, 1024)),
    OpCase("median with indices", _unary(lambda x: torch.median(x, dim=1), 256, 1024)),
    OpCase(
        "gather backward",
        _backward(lambda x: x.gather(0, torch.zeros_like(x, dtype=torch.long)), 65_536),
    ),
    OpCase(
        "index_select backward",
        _backward(lambda x: x[torch.arange(50_000, device=x.device) % 64], 64, 32),
    ),
    OpCase(
        "embedding backward",
        _backward(lambda w: F.embedding(torch.arange(50_000, device=w.device) % 64, w), 64, 32),
    ),
    OpCase("embedding_bag backward (sum)", _embedding_bag),
    OpCase("nll_loss2d", _nll_loss2d),
    OpCase("ctc_loss backward", _ctc),
    OpCase("grid_sample backward (bilinear)", _grid_sample),
    OpCase("interpolate backward linear", _interpolate("linear", 1)),
    OpCase("interpolate backward bilinear", _interpolate("bilinear", 2)),
    OpCase("interpolate backward bicubic", _interpolate("bicubic", 2)),
    OpCase("interpolate backward trilinear", _interpolate("trilinear", 3)),
    OpCase(
        "adaptive_avg_pool2d backward",
        _backward(lambda x: F.adaptive_avg_pool2d(x, 5), 4, 8, 32, 32),
    ),
    OpCase(
        "adaptive_avg_pool3d backward",
        _backward(lambda x: F.adaptive_avg_pool3d(x, 3), 2, 4, 8, 8, 8),
    ),
    OpCase(
        "adaptive_max_pool2d backward",
        _backward(lambda x: F.adaptive_max_pool2d(x, 5), 4, 8, 32, 32),
    ),
    OpCase("avg_pool3d backward", _backward(lambda x: F.avg_pool3d(x, 3, stride=1), 2, 4, 8, 8, 8)),
    OpCase("max_pool3d backward", _backward(lambda x: F.max_pool3d(x, 3, stride=1), 2, 4, 8, 8, 8)),
    OpCase("fractional_max_pool2d backward", _fractional),
    OpCase("max_unpool1d", _unpool(1)),
    OpCase("max_unpool2d", _unpool(2)),
    OpCase("max_unpool3d", _unpool(3)),
    OpCase(
        "reflection pad 2d backward",
        _backward(lambda x: F.pad(x, (3,) * 4, mode="reflect"), 4, 8, 32, 32),
    ),
    OpCase(
        "reflection pad 3d backward",
        _backward(lambda x: F.pad(x, (2,) * 6, mode="reflect"), 2, 4, 8, 8, 8),
    ),
    OpCase(
        "replication pad 2d backward",
        _backward(lambda x: F.pad(x, (3,) * 4, mode="replicate"), 4, 8, 32, 32),
    ),
    OpCase(
        "replication pad 3d backward",
        _backward(lambda x: F.pad(x, (2,) * 6, mode="replicate"), 2, 4, 8, 8, 8),
    ),
    OpCase("scaled_dot_product_attention backward", _sdpa),
)
