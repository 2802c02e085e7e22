"""The portable profile's own kernels (reprotrain.cpu.kernels).

What is shown on one host: the routed products agree with torch's to rounding,
give the same bits at any thread count, and the switch is explicit (off gives
torch's kernels back); dropout's mask is ATen's own stream; and a training step
of either shipped recipe under ``portable`` makes no MKL call, where ``native``
makes many (the negative control). That the bits are the same on another vendor
is what docs/cpu-profile.md's per-host rows show.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from fractions import Fraction

import numpy as np
import pytest
import torch

from reprotrain.cpu import gemm, kernels
from reprotrain.cpu.profile import CpuProfile
from reprotrain.cpu.routed import MKL_VML_OPS, ROUTED
from tests.helpers import ROOT


def _cpu_kernel(op: str) -> str:
    """Where the CPU kernel that ``aten::op`` dispatches to was registered."""
    kernel = torch._C._dispatch_get_computed_kernel_for_dispatch_key(
        f"aten::{op}", torch._C.DispatchKey.CPU
    )
    return repr(kernel)


@pytest.fixture
def routed() -> Iterator[None]:
    kernels.enable(1)
    yield
    kernels.disable()
    kernels.enable(1)  # the thread pool back to one thread
    kernels.disable()


def _products(seed: int = 0) -> list[torch.Tensor]:
    """Every routed product over operands of both layouts, odd sizes and a row count
    above one block, with the gradients of a convolution and of attention."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the convolution's initial weights
    out = []
    for m, n, k in [(300, 70, 50), (129, 3, 257), (1, 1, 1), (5, 0, 3), (7, 5, 0)]:
        a, at = torch.randn(m, k, generator=g), torch.randn(k, m, generator=g).t()
        b, bt = torch.randn(k, n, generator=g), torch.randn(n, k, generator=g).t()
        bias = torch.randn(n, generator=g)
        out += [
            a @ b,
            at @ bt,
            torch.addmm(bias, a, bt, beta=0.5, alpha=2.0),
            a.double() @ b.double(),
        ]
    q = torch.randn(6, 140, 16, generator=g, requires_grad=True)
    attention = torch.softmax(q @ q.transpose(1, 2), -1) @ q
    out += [attention, torch.baddbmm(q[:, :, :3], q, q.transpose(1, 2)[:, :, :3])]
    out.append(q @ torch.randn(16, 5, generator=g).expand(6, 16, 5))  # one matrix for all
    out.append(torch.autograd.grad(attention.square().sum(), q)[0])
    conv = torch.nn.Conv2d(3, 8, 5, stride=2, padding=1)
    x = torch.randn(4, 3, 28, 28, generator=g, requires_grad=True)
    y = conv(x)
    out += [y, *torch.autograd.grad(y.square().sum(), [x, conv.weight, conv.bias])]
    return [t.detach() for t in out]


def test_routed_products_agree_with_torch_and_are_not_torchs_kernels() -> None:
    mkldnn = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # the convolution's im2col path, as under portable
    try:
        theirs = _products()
        kernels.enable(1)
        ours = _products()
        kernels.disable()
        again = _products()
    finally:
        kernels.disable()
        torch.backends.mkldnn.enabled = mkldnn
    assert all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(theirs, ours, strict=True)
    )
    assert not all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))  # routed at all
    assert all(torch.equal(a, b) for a, b in zip(theirs, again, strict=True))  # off: torch's again


def test_the_thread_count_leaves_the_products_bits_alone() -> None:
    torch.backends.mkldnn.enabled = False
    try:
        runs = []
        for threads in (1, 2, 3):
            kernels.enable(threads)
            runs.append(_products())
    finally:
        kernels.disable()
        kernels.enable(1)
        kernels.disable()
        torch.backends.mkldnn.enabled = True
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


def test_matrices_called_one_at_a_time_give_the_bits_of_one_batched_call(
    routed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    batched = _products()
    monkeypatch.setattr(gemm, "_INT_MAX", 0)  # as for matrices 2**31 apart
    alone = _products()
    assert all(torch.equal(a, b) for a, b in zip(batched, alone, strict=True))


def test_another_row_block_gives_other_bits(routed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the block is fixed (and in the record): OpenBLAS's bits follow a call's shape."""
    blocked = _products()
    monkeypatch.setattr(gemm, "ROW_BLOCK", 64)
    assert not torch.equal(blocked[0], _products()[0])  # 300 rows: 3 blocks, now 5


def test_other_inputs_give_other_products(routed: None) -> None:
    one, other = _products(seed=0), _products(seed=1)
    assert not torch.equal(one[0], other[0]) and not torch.equal(one[-1], other[-1])


def _out_overloads() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each routed ``out=`` overload's result beside its functional twin's, into a fresh
    buffer, a wrong-shaped one (resized), a transposed one and one aliasing an input."""
    g = torch.Generator().manual_seed(3)
    a, b, bias = torch.randn(70, 50, generator=g), torch.randn(50, 30, generator=g), torch.randn(30)
    x, y = torch.randn(4, 70, 50, generator=g), torch.randn(4, 50, 30, generator=g)
    base = torch.randn(4, 70, 30, generator=g)
    pairs = []
    for out in (torch.empty(70, 30), torch.empty(0), torch.empty(30, 70).t()):
        pairs.append((torch.mm(a, b, out=out), torch.mm(a, b)))
        into = out.clone()
        pairs.append(
            (torch.addmm(bias, a, b, beta=0.5, out=into), torch.addmm(bias, a, b, beta=0.5))
        )
    pairs.append((torch.bmm(x, y, out=torch.empty(4, 70, 30)), torch.bmm(x, y)))
    expected = torch.baddbmm(base, x, y, alpha=2.0)
    pairs.append((torch.baddbmm(base, x, y, alpha=2.0, out=base), expected))  # out is an input
    return pairs


def test_out_overloads_give_the_functional_products_bits(routed: None) -> None:
    for index, (got, expected) in enumerate(_out_overloads()):
        assert torch.equal(got, expected), index
    assert "reprotrain/cpu/kernels.py" in _cpu_kernel("mm.out")  # not torch's kernel


def test_unrouted_out_overloads_are_torchs_kernels() -> None:
    """Negative control: without the switch the same calls reach torch's (MKL) kernels,
    whose sums differ from the routed blocks' somewhere in these products."""
    unrouted = [got for got, _ in _out_overloads()]
    kernels.enable(1)
    try:
        routed = [got for got, _ in _out_overloads()]
    finally:
        kernels.disable()
    assert any(not torch.equal(u, r) for u, r in zip(unrouted, routed, strict=True))


def test_integer_products_stay_exact(routed: None) -> None:
    a, b = torch.arange(12).reshape(3, 4), torch.arange(8).reshape(4, 2)
    assert torch.equal(a @ b, torch.tensor([[28, 34], [76, 98], [124, 162]]))  # torch's kernel


def test_dropouts_mask_is_atens_own_stream(routed: None) -> None:
    torch.manual_seed(5)
    ours = torch.empty(1000).bernoulli_(0.3)
    kernels.disable()
    torch.manual_seed(5)
    # ATen's generator path, which torch takes on AMD CPUs (and MKL's VSL on Intel ones)
    atens = torch.empty(1000).bernoulli_(torch.full((1000,), 0.3, dtype=torch.float64))
    assert torch.equal(ours, atens)


def test_another_seed_draws_another_mask(routed: None) -> None:
    masks = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        masks.append(torch.empty(1000).bernoulli_(0.3))
    assert not torch.equal(*masks)


def _square_root_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Values over the whole exponent range, subnormals and the special values included."""
    g = torch.Generator().manual_seed(0)
    low = -149 if dtype == torch.float32 else -1074
    exponents = torch.randint(low, 120, (200_000,), generator=g).to(torch.float64)
    x = (torch.rand(200_000, generator=g, dtype=torch.float64) + 1) * torch.exp2(exponents)
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -1.0, 1.0, 4.0]
    return torch.cat([x, torch.tensor(specials, dtype=torch.float64)]).to(dtype)


def _exact_roots(x: torch.Tensor) -> torch.Tensor:
    """The exact-rounded roots, made without the kernel under test: float32's from the
    float64 root (53 >= 2 * 24 + 2 bits: rounding twice is exact), float64's checked
    against rational arithmetic: r is the root iff x lies between the squares of r's
    half-ulp neighbours (a tie cannot occur: a float's square root is never halfway)."""
    roots = torch.from_numpy(np.sqrt(x.double().numpy()))
    if x.dtype == torch.float32:
        return roots.float()
    for value, root in zip(x[::97].tolist(), roots[::97].tolist(), strict=True):
        if not 0 < value < math.inf:
            continue
        half = Fraction(math.ulp(root)) / 2
        assert (Fraction(root) - half) ** 2 <= Fraction(value) <= (Fraction(root) + half) ** 2
    return roots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_routed_square_root_rounds_as_ieee_requires(routed: None, dtype: torch.dtype) -> None:
    """Adam's sqrt: the routed kernel (the CPU's square-root instruction through NumPy)
    gives the exact-rounded root; MKL's vector math, torch's kernel, does not."""
    x = _square_root_inputs(dtype)
    want = _exact_roots(x)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    number = ~want.isnan()
    out, in_place = torch.empty(0, dtype=dtype), x.clone()
    for got in (torch.sqrt(x), torch.sqrt(x, out=out), in_place.sqrt_()):
        assert torch.equal(got.isnan(), want.isnan())  # NaN's sign is the CPU's: not compared
        assert torch.equal(got[number].view(bits), want[number].view(bits))
    grid, grid_want = x[:200_000].reshape(400, 500), want[:200_000].reshape(400, 500)
    strided_out = torch.empty(500, 800, dtype=dtype)[:, ::2]
    torch.sqrt(grid.t(), out=strided_out)  # a transposed input into a strided output
    assert torch.equal(strided_out.view(bits), grid_want.t().contiguous().view(bits))
    assert torch.equal(torch.sqrt(x[5:6].expand(3)), want[5:6].expand(3))
    assert torch.sqrt(x.to(torch.bfloat16)).dtype == torch.bfloat16  # torch's kernel takes it
    assert "reprotrain/cpu/kernels.py" in _cpu_kernel("sqrt")  # not torch's kernel
    kernels.disable()
    assert _cpu_kernel("sqrt") == repr(kernels._torchs["sqrt"])  # off: torch's again
    theirs = torch.sqrt(x)  # the control: MKL's roots are not all exact, so the check can fail
    assert not torch.equal(theirs[number].view(bits), want[number].view(bits)), "MKL was exact"


def test_the_routed_square_root_promotes_casts_and_refuses_as_torch_does(routed: None) -> None:
    ints = torch.arange(1000)
    assert torch.equal(torch.sqrt(ints), _exact_roots(ints.float()))  # integers: float32
    into = torch.empty(1000, dtype=torch.float64)
    torch.sqrt(ints.float(), out=into)  # computed in float32, then cast
    assert torch.equal(into, _exact_roots(ints.float()).double())
    memory = torch.arange(5.0)
    for write in (
        lambda: torch.full((1,), 4.0).expand(3).sqrt_(),  # one element written three times
        lambda: torch.sqrt(memory[:-1], out=memory[1:]),  # reads what it writes
        lambda: torch.sqrt(memory, out=torch.empty(5, dtype=torch.long)),  # float into long
        lambda: torch.arange(4).sqrt_(),  # a float result into integers
    ):
        with pytest.raises(RuntimeError):
            write()


def test_every_routed_op_has_a_kernel() -> None:
    assert set(ROUTED) == set(kernels._KERNELS)
    assert CpuProfile("portable").record()["kernels"]["routed"] == list(ROUTED)
    assert "kernels" not in CpuProfile("native").record()


@functools.cache
def _steps(profile: str, recipe: str) -> tuple[int, frozenset[str]]:
    """MKL calls (MKL_VERBOSE lines) during two training steps of a recipe's model, and
    the aten overloads those steps called."""
    script = ROOT / "tests" / "scripts" / "mkl_calls.py"
    env = {
        **os.environ,
        **CpuProfile(profile).variables(),
        "MKL_VERBOSE": "1",
        "PYTHONHASHSEED": "0",
    }
    done = subprocess.run(
        [sys.executable, str(script), recipe, profile],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert "MARK stepped" in lines, done.stdout[-2000:] + done.stderr[-2000:]
    steps = lines[lines.index("MARK start") : lines.index("MARK stepped")]
    ops = json.loads(next(line for line in lines if line.startswith("OPS ")).removeprefix("OPS "))
    return sum(line.startswith("MKL_VERBOSE") for line in steps), frozenset(ops)


_COMPILED = pytest.param("lm-compiled", marks=pytest.mark.slow)  # Inductor builds C++


@pytest.mark.parametrize("recipe", ["digits", "lm", _COMPILED])
def test_a_portable_training_step_makes_no_mkl_call(recipe: str) -> None:
    """``lm-compiled``: torch.compile's matrix products call the ``out=`` overloads."""
    assert _steps("portable", recipe)[0] == 0


@pytest.mark.parametrize("recipe", ["digits", "lm", _COMPILED])
def test_a_native_training_step_calls_mkl(recipe: str) -> None:
    assert _steps("native", recipe)[0] > 0  # MKL's verbose mode does count the calls


def _unrouted_vector_math(ops: frozenset[str], routed: frozenset[str]) -> set[str]:
    return {op for op in ops if op in MKL_VML_OPS and op not in routed}


@pytest.mark.parametrize("recipe", ["digits", "lm"])
def test_a_portable_training_step_calls_mkls_vector_math_only_where_routed(recipe: str) -> None:
    """MKL's verbose mode does not count its vector math (VML): the ops that reach it are
    checked by name instead; Adam's sqrt is one, and routed."""
    ops = _steps("portable", recipe)[1]
    assert "sqrt" in ops and "sqrt" in ROUTED
    assert _unrouted_vector_math(ops, frozenset(ROUTED)) == set()


@pytest.mark.parametrize("recipe", ["digits", "lm"])
def test_a_native_training_step_reaches_mkls_vector_math(recipe: str) -> None:
    assert _unrouted_vector_math(_steps("native", recipe)[1], frozenset()) >= {"sqrt"}
