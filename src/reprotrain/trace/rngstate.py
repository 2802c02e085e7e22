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
a capture reads both generators' C structs in place instead (a few µs; where
they have not moved, the state object taken last is reused). Where a layout
is not the one expected (checked once per process), it calls the libraries.
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
_MT19937_WORDS = 624
_MT19937_BYTES = _MT19937_WORDS * 4 + 4  # numpy's mt19937_state: uint32 key[624], then int pos
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
    """numpy's legacy ``get_state()``, read in place; the previous capture's if unchanged.

    ``get_state`` copies the 624 key words one by one (50-90 µs). Read in
    place instead: the MT19937 struct (key words, then position) and the
    global ``RandomState``'s cached gaussian (``has_gauss``, ``gauss``, at the
    offset :func:`_gauss_offset` found), 3 µs. Where either cannot be read,
    ``get_state`` it is.
    """
    legacy = np.random.random.__self__  # the global RandomState behind np.random.*
    generator = legacy._bit_generator
    offset = _gauss_offset()
    if offset is None or type(generator) is not np.random.MT19937:
        return np.random.get_state(legacy=True)
    raw = ctypes.string_at(generator.ctypes.state_address, _MT19937_BYTES)
    gauss = ctypes.string_at(id(legacy) + offset, 16)
    if previous is not None:
        _, keys, pos, has_gauss, cached = previous[1]
        if raw == keys.tobytes() + struct.pack("=i", pos) and gauss == _gauss_bytes(
            has_gauss, cached
        ):
            return previous[1]
    has_gauss, cached = struct.unpack("=i4xd", gauss)
    keys = np.frombuffer(raw, np.uint32, _MT19937_WORDS).copy()
    (pos,) = struct.unpack("=i", raw[-4:])
    return "MT19937", keys, pos, has_gauss, cached


def _gauss_bytes(has_gauss: int, cached: float) -> bytes:
    return struct.pack("=i4xd", has_gauss, cached)


@functools.cache
def _gauss_offset() -> int | None:
    """Where numpy's RandomState keeps ``has_gauss`` (``gauss`` 8 bytes on), or None.

    Its C struct holds a copy of the bit generator's ``bitgen_t`` (whose first
    field points at the MT19937 state) and then ``aug_bitgen_t`` (a pointer to
    that copy, ``int has_gauss``, ``double gauss``): both found by value in a
    private RandomState of our own, and checked against its ``get_state``
    with a cached gaussian and without one.
    """
    try:
        probe = np.random.RandomState(12345)
        size = type(probe).__basicsize__ // 8 * 8
        words = struct.unpack(f"={size // 8}Q", ctypes.string_at(id(probe), size))
        copy = id(probe) + 8 * words.index(probe._bit_generator.ctypes.state_address)
        offset = 8 * words.index(copy) + 8
    except (AttributeError, ValueError, struct.error):
        return None
    for _ in range(2):  # a gaussian cached, then used
        probe.standard_normal()
        _, _, _, has_gauss, cached = probe.get_state(legacy=True)
        if offset + 16 > size or ctypes.string_at(id(probe) + offset, 16) != _gauss_bytes(
            has_gauss, cached
        ):
            return None
    return offset


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
