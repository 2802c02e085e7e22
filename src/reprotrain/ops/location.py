"""Where a recorded op comes from: the user's source line, and a backward op's forward op.

:func:`user_line` walks out of the call stack to the innermost frame that is
the user's: not torch, Lightning or the standard library, and not
reprotrain's library (the pipeline and the built-in recipes, users of the library, count as a
user). Whether a frame is the library's is decided by its module's name, so
the library's layout (subpackages) does not matter. An op run by the step
trace (:data:`BOOKKEEPING`) gets "": the recorder leaves those out, so a
recording does not depend on whether, or how often, a trace ran.

:class:`NodeMakers` names the forward op behind each autograd node, so a
backward op carries the module and line of the forward call that made its
node. Autograd numbers nodes in the order it makes them; a custom
``autograd.Function``'s node (no op makes it) is tagged by the module hooks.
Limits: a node made outside the recorded step, or by a thread other than the
step's, has no maker; the recorder then names the leaf it accumulates into.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

__all__ = ["BOOKKEEPING", "NodeMakers", "user_line"]

#: Packages whose ops are the step trace's bookkeeping, not the step's computation.
BOOKKEEPING = ("reprotrain.trace", "reprotrain.fingerprint")
#: reprotrain's packages whose lines are a user's: the pipeline and the built-in recipes
#: use the library as a user's code does.
USER_PACKAGES = ("reprotrain.pipeline", "reprotrain.recipes")
_USER, _LIBRARY, _TRACE = 0, 1, 2
_NODE_KEY = "reprotrain.ops.recorder"  # the tag's key in a custom Function node's metadata
Maker = tuple[str, str]  # (module, line) of a forward op


def _within(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in packages)


@functools.cache
def _skipped_dirs() -> tuple[str, ...]:
    dirs = [Path(torch.__file__).parent, Path(sysconfig.get_paths()["stdlib"])]
    lightning = importlib.util.find_spec("lightning")  # found, not imported
    if lightning is not None and lightning.origin is not None:
        dirs.append(Path(lightning.origin).parent)
    return tuple(f"{d.resolve()}{os.sep}" for d in dirs)


_kinds: dict[str, int] = {}  # file name -> _USER, _LIBRARY or _TRACE
_shown_lines: dict[tuple[str, int], str] = {}  # (file name, line) -> "file:line" as shown


def _kind(frame: Any) -> int:
    name = frame.f_code.co_filename
    kind = _kinds.get(name)
    if kind is None:
        module = frame.f_globals.get("__name__", "")
        if _within(module, BOOKKEEPING):
            kind = _TRACE
        elif _within(module, ("reprotrain",)) and not _within(module, USER_PACKAGES):
            kind = _LIBRARY
        else:
            kind = _LIBRARY if str(Path(name).resolve()).startswith(_skipped_dirs()) else _USER
        _kinds[name] = kind
    return kind


def user_line(depth: int = 2) -> str:
    """``file:line`` of the innermost user frame, from ``depth`` frames out; "?" if none.

    "" when the call comes from the step trace (a :data:`BOOKKEEPING` frame on the way out).
    """
    frame = sys._getframe(depth)
    while frame is not None:
        kind = _kind(frame)
        if kind == _TRACE:
            return ""
        if kind == _USER:
            where = (frame.f_code.co_filename, frame.f_lineno)
            if (line := _shown_lines.get(where)) is None:
                shown = os.path.relpath(where[0])
                line = f"{where[0] if shown.startswith('..') else shown}:{where[1]}"
                _shown_lines[where] = line
            return line
        frame = frame.f_back
    return "?"


class NodeMakers:
    """(module, line) of the forward op that made each autograd node of a step."""

    def __init__(self) -> None:
        self._made: dict[int, Maker] = {}  # node sequence number -> its maker
        self._next = torch._C._autograd._get_sequence_nr()  # first number not yet seen
        self._last: Maker = ("-", "?")  # the previous forward op's maker

    def begin_step(self) -> None:
        """Nodes made before now are not this step's."""
        self._next = torch._C._autograd._get_sequence_nr()

    def before_forward_op(self, made: Maker) -> None:
        """Before a forward op runs: name the autograd nodes made since the previous one.

        Autograd makes an op's node just before the op reaches the dispatch mode.
        So with grad on, the newest number is this op's node (when it made one; if
        not, that number is named already), and older new ones were made after the
        previous op (``CopySlices`` after an in-place op on a view): the previous
        op's. With grad off no op makes a node: a new one is a custom
        ``autograd.Function``'s, made before its forward's first op, named here by
        that op; the module hooks tag it with the module's call (:meth:`tag_new`),
        and the tag wins (:meth:`maker`).
        """
        newest = torch._C._autograd._get_sequence_nr()
        first, self._next = self._next, newest
        if newest > first:
            earlier = made
            if torch.is_grad_enabled():
                self._made.setdefault(newest - 1, made)
                newest, earlier = newest - 1, self._last
            for number in range(first, newest):
                self._made.setdefault(number, earlier)
        self._last = made

    def maker(self, node: Any) -> Maker | None:
        """(module, line) of the forward op that made autograd ``node``, None if unknown."""
        tag = node.metadata.get(_NODE_KEY) if isinstance(node, BackwardCFunction) else None
        return tag or self._made.get(node._sequence_nr())

    def tag_new(self, nodes: list[Any], tag: Callable[[], Maker]) -> None:
        """Tag the custom ``autograd.Function`` nodes reachable from ``nodes`` by new nodes.

        The walk stops at a tagged node and at a node named by its sequence number
        (a built-in op's, named as it was made). ``tag`` is called once, if needed.
        """
        value = None
        todo = [n for n in nodes if n is not None]
        while todo:
            node = todo.pop()
            if not hasattr(node, "next_functions") or _NODE_KEY in node.metadata:
                continue
            if not isinstance(node, BackwardCFunction) and (
                node._sequence_nr() in self._made or node.name().endswith("AccumulateGrad")
            ):
                continue
            value = value or tag()
            node.metadata[_NODE_KEY] = value
            todo.extend(n for n, _ in node.next_functions if n is not None)
