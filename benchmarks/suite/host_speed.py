"""How fast this host is right now: read it beside any suite or benchmark time you compare.

The build hosts are virtual machines whose speed moves from hour to hour (the
same quick suite took 268 s and 626 s on one kind of host, docs/lab.md). Three
probes, each a few seconds: a pure-Python loop (the CPU alone); touching fresh
memory, 2 GiB of new pages twice in a row (a guest's first touch of a page may
wait for its host; the second round reuses nothing either, since the pages are
given back between rounds); and ``import torch`` in a fresh interpreter, what
every process of the suite pays first. Compare two timings only beside two
outputs of this that agree. Run from the repository root::

    .venv/bin/python benchmarks/suite/host_speed.py
"""

from __future__ import annotations

import mmap
import subprocess
import sys
import time

PAGE = mmap.PAGESIZE
GIB = 1 << 30


def _loop_s() -> float:
    start = time.perf_counter()
    sum(range(30_000_000))
    return time.perf_counter() - start


def _first_touch_us_per_page(size: int = 2 * GIB) -> float:
    """Microseconds per page to touch ``size`` bytes of fresh anonymous memory."""
    area = mmap.mmap(-1, size)
    start = time.perf_counter()
    for offset in range(0, size, PAGE):
        area[offset] = 1
    seconds = time.perf_counter() - start
    area.close()  # unmapped: the next round gets fresh pages again
    return seconds / (size // PAGE) * 1e6


def _import_torch_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def main() -> None:
    print(f"python loop (3e7 additions): {_loop_s():.2f} s")
    rounds = [_first_touch_us_per_page() for _ in range(2)]
    print("first touch of 2 GiB, two rounds: " + ", ".join(f"{r:.1f} us/page" for r in rounds))
    print(f"import torch, fresh interpreter: {_import_torch_s():.2f} s")


if __name__ == "__main__":
    main()
