"""Where a test run's CPU goes: every process's CPU seconds, by test folder and by command.

The suite is CPU-bound on 2 cores (``/proc/stat`` busy 89-96% while it runs), so
its wall time falls only with the CPU it spends. ``time`` counts the processes
pytest reaps, not the ones a test's command forks from the warm interpreters
(``src/reprotrain/_zygote.py``) nor what DVC starts detached; this samples
``/proc`` every ``--interval`` seconds while COMMAND runs and charges each
process the CPU it used while sampled (user + system, its own threads, not its
children) to its working directory's test folder (``.../popen-gwN/<test>``:
the test or module fixture that started it, served children included, since a
served child takes its requester's working directory) and to its command
(interpreter, then the first arguments). A process that lives less than one
interval is missed, as is what a process spends after its last sample, so the
sampled total falls short of the CPUs' busy time (``/proc/stat``, printed beside
it); kernel threads appear under ``/``.

    .venv/bin/python benchmarks/suite/suite_cpu.py [--top 40] -- .venv/bin/pytest -m slow -n auto \\
        --dist loadfile
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")


def _sample(seen: dict[str, list]) -> None:
    """Update ``seen`` (pid:start time -> [cpu at start, cpu last seen, cwd, command])."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / HZ
            key = f"{entry.name}:{fields[19]}"
            cwd = str(Path(entry.path, "cwd").readlink())
            if key in seen:
                seen[key][1:3] = [cpu, cwd]
                continue
            raw = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
            seen[key] = [0.0, cpu, cwd, raw.decode(errors="replace")]  # started since
        except (OSError, ValueError, IndexError):  # ended between listing and reading
            continue


def _busy_total() -> tuple[float, float]:
    """CPU seconds all CPUs were busy, and in all, since boot (``/proc/stat``)."""
    ticks = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / HZ, sum(ticks) / HZ


def _folder(cwd: str) -> str:
    match = re.search(r"/pytest-\d+/(?:popen-gw\d+/)?([^/]+)", cwd)
    return re.sub(r"\d+$", "", match.group(1)) if match else cwd


def _command(line: str) -> str:
    words = [w.rsplit("/", 1)[-1] for w in line.split()[:4] if not w.startswith("/tmp")]
    return " ".join(words)[:60] or "(kernel thread or no command line)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    seen: dict[str, list] = {}
    _sample(seen)
    for row in seen.values():  # what ran before the command is charged from now on
        row[0] = row[1]
    start, busy_start = time.monotonic(), _busy_total()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        _sample(seen)
        time.sleep(args.interval)
    wall = time.monotonic() - start
    busy, everything = (end - begin for end, begin in zip(_busy_total(), busy_start, strict=True))
    own = os.getpid()
    by_folder: collections.Counter[str] = collections.Counter()
    by_command: collections.Counter[str] = collections.Counter()
    for key, (first, last, cwd, line) in seen.items():
        if int(key.split(":")[0]) == own:
            continue
        by_folder[_folder(cwd)] += last - first
        by_command[_command(line)] += last - first
    total = sum(by_folder.values())
    share = busy / everything
    print(f"\nsuite_cpu: {wall:.0f} s wall, {os.cpu_count()} CPUs {share:.0%} busy ({busy:.0f} "
          f"CPU s), {total:.0f} CPU s of it sampled; exit {proc.returncode}")  # fmt: skip
    for title, counts in (("test folder", by_folder), ("command", by_command)):
        print(f"\n  CPU s  share  {title}")
        for name, seconds in counts.most_common(args.top):
            print(f"{seconds:7.1f} {seconds / total:6.1%}  {name[:90]}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
