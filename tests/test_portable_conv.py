"""The portable profile's convolutions (reprotrain.cpu.conv): their buffers and kept columns.

What is shown: a convolution's results are its own though its buffers are reused;
the columns a forward keeps for its backward give the bits of columns copied anew,
are used (the kept list fills and empties), are not used for an input changed in
place since the forward (the control: used anyway, the weight gradient differs),
and stay within :data:`~reprotrain.cpu.conv.KEEP_BYTES`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from reprotrain.cpu import conv, kernels

CONV = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)  # stride, padding, dilation, transposed, ...


@pytest.fixture
def routed() -> Iterator[None]:
    kernels.enable(1)
    yield
    kernels.disable()


def _kept() -> list[conv._Kept]:
    return conv._thread_list("kept")


def _step(seed: int = 0) -> list[torch.Tensor]:
    """A small network's output and gradients: two convolutions, the first one's input not
    requiring a gradient (as a batch of images)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 9, 9, generator=g)
    first = torch.randn(6, 3, 3, 3, generator=g).requires_grad_()
    second = torch.randn(5, 6, 3, 3, generator=g).requires_grad_()
    y = torch.nn.functional.conv2d(
        torch.relu(torch.nn.functional.conv2d(x, first)), second, padding=1
    )
    return [y.detach(), *torch.autograd.grad(y.square().sum(), [first, second])]


@pytest.mark.parametrize("padding", [0, 1])
def test_a_convolutions_results_outlive_the_next_convolution(routed: None, padding: int) -> None:
    """The column matrices are buffers reused from call to call (``_workspace``); what a
    convolution returns stays its own. One image, and no padding, are where a contiguous
    view of a buffer would have been handed out instead of a copy."""

    def convolve(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 3, 9, 9, generator=g).requires_grad_()
        weight = torch.randn(4, 3, 3, 3, generator=g).requires_grad_()
        y = torch.nn.functional.conv2d(x, weight, padding=padding)
        return [y, *torch.autograd.grad(y.square().sum(), [x, weight])]

    first = convolve(0)
    kept = [t.clone() for t in first]
    second = convolve(1)
    assert all(torch.equal(a, b) for a, b in zip(first, kept, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # the control


def test_kept_columns_give_the_bits_of_columns_copied_anew(
    routed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = _step()
    monkeypatch.setattr(conv, "KEEP_BYTES", 0)  # nothing fits: every backward copies
    copied = _step()
    assert all(torch.equal(a, b) for a, b in zip(kept, copied, strict=True))


def test_a_forward_keeps_its_columns_until_its_backward(routed: None) -> None:
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 3, 9, 9, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    with torch.no_grad():
        torch.nn.functional.conv2d(x, weight.requires_grad_())
    assert _kept() == []  # no gradient will be taken
    y = torch.nn.functional.conv2d(x, weight)
    assert len(_kept()) == 1 and _kept()[0].memory.data_ptr() == x.untyped_storage().data_ptr()
    y.sum().backward()
    assert _kept() == []


def test_kept_columns_are_not_used_for_an_input_changed_since(routed: None) -> None:
    """The ops called directly: autograd itself would refuse a backward over a changed input."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 3, 9, 9, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    grad, masks = torch.randn(2, 4, 9, 9, generator=g), [False, True, False]

    def forward_then_double_x() -> None:
        with torch.enable_grad():
            torch.ops.aten.convolution(x, weight.requires_grad_(), None, *CONV)
        x.mul_(2)

    def weight_gradient() -> torch.Tensor:
        return torch.ops.aten.convolution_backward(grad, x, weight, None, *CONV, masks)[1]

    forward_then_double_x()
    after_change = weight_gradient()
    conv.forget()
    assert torch.equal(after_change, weight_gradient())  # nothing kept: copied anew
    x.div_(2)
    forward_then_double_x()
    _kept()[-1].version = x._version  # the control: the change goes unseen, stale columns used
    assert not torch.equal(weight_gradient(), after_change)


def test_kept_columns_stay_within_their_bytes(
    routed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 3, 9, 9, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    weight.requires_grad_()
    one = (3 * 9 * 2 * 7 * 7 + x.numel()) * x.element_size()  # columns and input, no padding
    monkeypatch.setattr(conv, "KEEP_BYTES", one)
    outputs = [torch.nn.functional.conv2d(x, weight) for _ in range(3)]
    assert len(_kept()) == 1
    monkeypatch.setattr(conv, "KEEP_BYTES", one - 1)  # the control: one too big
    conv.forget()
    outputs.append(torch.nn.functional.conv2d(x, weight))
    assert _kept() == []
    assert all(torch.equal(outputs[0], y) for y in outputs)
