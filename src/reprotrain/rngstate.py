"""The raw states of the global random number generators, and their blake2b digests.

:func:`rng_states` gives the state of python's ``random``, numpy's legacy
global ``RandomState``, torch's CPU generator and each CUDA device's (only
where CUDA is already initialised: asking would start a context on every GPU)
as bytes. :func:`capture_rng` takes the same states as the libraries return
them, each a fresh copy: cheap to take, safe to keep, and turned into the same
bytes later. A per-step trace captures at every step and hashes many captures
at once (:class:`RngDigests`), where the hashing code runs hot.

Guarantee: for a capture, ``RngDigests`` gives exactly the blake2b digests of
the ``rng_states()`` of that moment, however many captures it hashes together
and in whatever order. Limits: only the global generators (a
``torch.Generator`` of your own shows only through what it draws). Reading
numpy's state with ``get_state`` costs 40-60 µs on a 2-core machine (numpy
copies its 624 key words one by one, and only ``get_state`` gives the cached
gaussian that is part of the state), and python's ``getstate`` about 30 µs;
a capture reads each generator's struct in place (2 µs) and reuses the state
it took last when that cannot have changed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import random
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["RngCapture", "RngDigests", "capture_rng", "hash_bytes", "rng_states"]

_LABELS = {"numpy": b"numpy\0", "torch": b"torch\0"}  # name and 0 byte before a state
_MT19937_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], then int pos
_PYTHON_WORDS = 624
_PYTHON_BYTES = 4 + _PYTHON_WORDS * 4  # CPython's generator: int index, then uint32 state[624]
_python_seen: list[Any] = []  # raw bytes, repr(gauss_next) and getstate() of the last state taken

#: python's getstate(), numpy's legacy get_state(), torch's CPU state, each CUDA device's.
RngCapture = tuple[tuple[Any, ...], tuple[Any, ...], torch.Tensor, list[torch.Tensor]]


def hash_bytes(data: bytes) -> int:
    """blake2b (8 bytes) of ``data`` as a signed little-endian int64."""
    return _digest_int(hashlib.blake2b(data, digest_size=8))


def _digest_int(hasher: Any) -> int:
    return int.from_bytes(hasher.digest(), "little", signed=True)


def capture_rng(previous: RngCapture | None = None) -> RngCapture:
    """Every global RNG's state as its library returns it (copies, not views).

    Given the ``previous`` capture, an unchanged python state is that
    capture's very object: kept once, and known at a glance when hashed.
    """
    python = _python_state()
    if (
        previous is not None
        and previous[0] is not python
        and _same_python_state(previous[0], python)
    ):
        python = previous[0]
    cuda = []
    if torch.cuda.is_initialized() and torch.cuda.is_available():  # the cheap test first
        cuda = [generator.get_state() for generator in torch.cuda.default_generators]
    return python, _numpy_state(previous), torch.get_rng_state(), cuda


def _python_state() -> tuple[Any, ...]:
    """``random.getstate()``; the last one this module took when the generator has not moved.

    ``getstate`` builds 625 Python ints (about 30 µs, and as long again to
    compare them). CPython's generator object holds ``int index`` and
    ``uint32 state[624]`` right after the object header: those 2500 bytes are
    read in place (2 µs), checked against ``getstate`` once per process, and
    with ``gauss_next`` decide whether the last state taken is still the state.
    """
    generator = random.getstate.__self__
    if not _python_layout_known(generator):
        return random.getstate()
    raw = ctypes.string_at(id(generator) + object.__basicsize__, _PYTHON_BYTES)
    gauss = repr(generator.gauss_next)
    if _python_seen and _python_seen[0] == raw and _python_seen[1] == gauss:
        return _python_seen[2]
    state = random.getstate()
    _python_seen[:] = [raw, gauss, state]
    return state


@functools.cache
def _python_layout_known(generator: random.Random) -> bool:
    """Whether the generator's state lies where _python_state reads it (checked once)."""
    if type(generator).__basicsize__ < object.__basicsize__ + _PYTHON_BYTES:
        return False
    raw = ctypes.string_at(id(generator) + object.__basicsize__, _PYTHON_BYTES)
    index, *words = struct.unpack(f"=i{_PYTHON_WORDS}I", raw)
    _, state, _ = generator.getstate()
    return list(state) == [*words, index]


def _numpy_state(previous: RngCapture | None) -> tuple[Any, ...]:
    """numpy's legacy ``get_state()``; the previous capture's when it cannot have changed.

    ``get_state`` copies the 624 key words one by one (about 50 µs). The
    MT19937 struct (key words, then position) is read in place instead, 2 µs;
    if it equals the previous capture's and that one held no cached gaussian,
    nothing was drawn since (drawing a gaussian moves the position unless it
    uses the cached one, and with none cached there is none to use), so the
    previous state object is the state.
    """
    generator = np.random.get_bit_generator()
    if previous is not None and previous[1][3] == 0 and type(generator) is np.random.MT19937:
        _, keys, pos, _, _ = previous[1]
        now = ctypes.string_at(generator.ctypes.state_address, _MT19937_BYTES)
        if now == keys.tobytes() + struct.pack("=i", pos):
            return previous[1]
    return np.random.get_state(legacy=True)


def rng_states(captured: RngCapture | None = None) -> dict[str, bytes]:
    """The raw state of each global RNG, now or as ``captured``: python, numpy, torch, cuda:N."""
    captured = captured or capture_rng()
    return {"python": _python_bytes(_python_key(captured[0])), **_other_states(captured)}


def _python_key(state: tuple[Any, ...]) -> tuple[tuple[int, ...], str]:
    """python's state as (words, repr of the rest): equal keys give equal bytes.

    Not the state tuple itself: ``0.0 == -0.0`` and ``1 == 1.0``, but their reprs differ.
    """
    version, words, gauss = state
    return words, repr((version, gauss))


def _same_python_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two python states give the same bytes: _python_key's test, cheapest first."""
    return a[1] == b[1] and repr((a[0], a[2])) == repr((b[0], b[2]))


def _python_bytes(key: tuple[tuple[int, ...], str]) -> bytes:
    words, rest = key
    return array("Q", words).tobytes() + rest.encode()


def _other_states(captured: RngCapture) -> dict[str, bytes]:
    """The bytes of every source after python's, in rng_states' order."""
    return {name: b"".join(parts) for name, parts in _other_parts(captured).items()}


def _other_parts(captured: RngCapture) -> dict[str, tuple[Any, ...]]:
    """_other_states as buffers, whose bytes make up each source's: hashed without a copy."""
    _, (_, keys, pos, has_gauss, cached), torch_state, cuda = captured
    out = {
        "numpy": (keys, struct.pack("<qqd", pos, has_gauss, cached)),
        "torch": (torch_state.numpy(),),
    }
    for index, state in enumerate(cuda):
        out[f"cuda:{index}"] = (state.numpy(),)
    return out


class RngDigests:
    """The digests a trace records for a capture: all sources together, then each source.

    The combined digest hashes every source's name, a 0 byte and its state, in
    rng_states' order. ``per_source`` names the sources that get a digest of
    their own (0 where a capture lacks one). Python's state comes first and
    seldom changes between steps: while it stays the same, its bytes and
    their hashes are reused.
    """

    def __init__(self, per_source: Sequence[str] = ()) -> None:
        self.per_source = tuple(per_source)
        self._python: tuple[Any, ...] | None = None  # state, its key, hasher, own digest

    def __call__(self, captured: RngCapture) -> list[int]:
        combined, python_digest = self._python_part(captured[0])
        combined = combined.copy()
        others = _other_parts(captured)
        for name, parts in others.items():
            combined.update(_LABELS.get(name) or name.encode() + b"\0")
            for part in parts:
                combined.update(part)
        sources = [
            python_digest
            if s == "python"
            else hash_bytes(b"".join(others[s]))
            if s in others
            else 0
            for s in self.per_source
        ]
        return [_digest_int(combined), *sources]

    def _python_part(self, state: tuple[Any, ...]) -> tuple[Any, int]:
        """blake2b fed with python's name and state, and the state's own digest (or 0)."""
        cached = self._python
        if cached is None or not (cached[0] is state or cached[1] == _python_key(state)):
            data = _python_bytes(_python_key(state))
            prefix = hashlib.blake2b(b"python\0" + data, digest_size=8)
            own = hash_bytes(data) if "python" in self.per_source else 0
            cached = (state, _python_key(state), prefix, own)
        self._python = (state, *cached[1:])
        return cached[2:]
