"""What ``torch.compile`` costs and wins under reprotrain: a Lightning training step, five ways.

Times ``Trainer.fit`` steps of the LM recipe's ``TinyGPT`` (SDPA attention, every block
compiled in ``configure_model``: the pipelines/lm-compiled model at n_layer 2, n_head 2,
n_embd 64, batch 32 x 64 tokens, AdamW, fp32) in fresh processes, the ways alternating in
every round so the host's drift falls on all of them alike:

* ``lightning eager``: plain Lightning, uncompiled, torch's defaults;
* ``lightning compiled``: plain Lightning, compiled, ``Trainer(deterministic=False)``;
* ``lightning compiled det``: the same with ``Trainer(deterministic=True)``;
* ``reprotrain native``: ``reprotrain run --cpu-profile native``, ``configure_determinism``
  and its ``trainer_flags()`` (deterministic), compiled;
* ``reprotrain portable``: the same under ``--cpu-profile portable`` (pinned kernels).

Each process compiles (one step, warm Inductor cache after the first round), skips
``--warmup`` steps and records the median of the next ``--steps``; a way's figure is the
median over rounds, and its ratio to ``lightning compiled``. One thread each (the
profiles' default; plain ways get ``torch.set_num_threads(1)``). Run from the repository
root::

    .venv/bin/python benchmarks/cpu/compile_speed.py [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WAYS = (
    "lightning eager",
    "lightning compiled",
    "lightning compiled det",
    "reprotrain native",
    "reprotrain portable",
)
BASE = "lightning compiled"


def child(way: str, warmup: int, steps: int) -> None:
    """One process's way: print ``STEP_S`` and the median step time."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from reprotrain.recipes.language_model import TinyGPT

    reprotrain = way.startswith("reprotrain")
    if reprotrain:
        from reprotrain.determinism import configure_determinism

        flags = configure_determinism(0, True).trainer_flags()
    else:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        flags = {"deterministic": way.endswith("det")}
    compiled = way != "lightning eager"
    model = TinyGPT(vocab_size=65, block_size=64, attention="sdpa", compile=compiled)
    tokens = torch.randint(0, 65, (32 * (1 + warmup + steps), 65))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=32)
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *_: object) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_: object) -> None:
            times.append(time.perf_counter() - self.start)

    trainer = L.Trainer(
        **flags,
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer()],
    )
    trainer.fit(model, data)
    print("STEP_S", json.dumps(statistics.median(times[1 + warmup :])), flush=True)


def run_way(way: str, warmup: int, steps: int) -> float:
    me = [sys.executable, __file__, "--child", way, "--warmup", str(warmup), "--steps", str(steps)]
    if way.startswith("reprotrain"):
        profile = way.split()[1]
        me = [sys.executable, "-m", "reprotrain", "run", "--cpu-profile", profile, "--", *me]
    done = subprocess.run(me, capture_output=True, text=True, check=False, env=os.environ)
    if done.returncode != 0:
        raise SystemExit(f"{way}: exit {done.returncode}\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("STEP_S "))
    return float(line.removeprefix("STEP_S "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="steps after the compiling one")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.warmup, args.steps)
        return
    medians: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            medians[way].append(run_way(way, args.warmup, args.steps))
    base = statistics.median(medians[BASE])
    print(
        f"TinyGPT (sdpa, 2 x 64), batch 32 x 64, fp32, {args.rounds} rounds of {args.steps} steps"
    )
    for way, runs in medians.items():
        step_s = statistics.median(runs)
        rounds = ", ".join(f"{r * 1e3:.1f}" for r in runs)
        ratio = f"x{step_s / base:.3f} ({BASE})"
        print(f"  {way:24s} {step_s * 1e3:7.2f} ms  {ratio}  | rounds (ms): {rounds}")


if __name__ == "__main__":
    main()
