"""What ``torch.compile`` costs and wins under reprotrain: a Lightning training step, five ways.

Times ``Trainer.fit`` steps of the LM recipe's ``TinyGPT`` (SDPA attention, every block
compiled in ``configure_model``: the pipelines/lm-compiled model) in fresh processes,
the ways alternating in every round so the host's drift falls on all of them alike:

* ``lightning eager``: plain Lightning, uncompiled, torch's defaults;
* ``lightning compiled``: plain Lightning, compiled, ``Trainer(deterministic=False)``;
* ``lightning compiled det``: the same with ``Trainer(deterministic=True)``;
* ``reprotrain native``: ``reprotrain run --cpu-profile native``, ``configure_determinism``
  and its ``trainer_flags()`` (deterministic), compiled;
* ``reprotrain portable``: the same under ``--cpu-profile portable`` (pinned kernels).

``--device cpu`` (the default): ``--size cpu`` (n_layer 2, n_head 2, n_embd 64, batch
32 x 64 tokens, fp32, one thread: the profiles' default; plain ways get
``torch.set_num_threads(1)``). ``--device cuda``: ``--size gpu`` (n_layer 8, n_head 8,
n_embd 512, batch 32 x 128 tokens: 25.3M parameters, ``bf16-mixed``), where the two
profile ways are one, ``reprotrain`` (``reprotrain run``, ``configure_determinism``:
the CPU profiles pin CPU kernels only), and every step ends synchronised.

Each process compiles (one step, warm Inductor cache after the first round), skips
``--warmup`` steps and records the median of the next ``--steps``; a way's figure is the
median over rounds, and its ratio to ``lightning compiled``. Run from the repository
root (``--json PATH`` also writes the figures; ``make gpu-evidence`` runs it on a GPU)::

    .venv/bin/python benchmarks/overhead/compile_speed.py [--rounds 3] [--steps 30]
    PYTHONPATH=src python3 benchmarks/overhead/compile_speed.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CPU_WAYS = (
    "lightning eager",
    "lightning compiled",
    "lightning compiled det",
    "reprotrain native",
    "reprotrain portable",
)
GPU_WAYS = ("lightning eager", "lightning compiled", "lightning compiled det", "reprotrain")
BASE = "lightning compiled"
#: --size -> TinyGPT's arguments, the batch, the tokens per sample and Lightning's precision
SIZES = {
    "cpu": ({"n_layer": 2, "n_head": 2, "n_embd": 64}, 32, 64, "32-true"),
    "gpu": ({"n_layer": 8, "n_head": 8, "n_embd": 512}, 32, 128, "bf16-mixed"),
    "tiny": ({"n_layer": 1, "n_head": 2, "n_embd": 16}, 4, 16, "32-true"),  # dry runs
}
VOCAB = 65


def child(way: str, args: argparse.Namespace) -> None:
    """One process's way: print ``STEP_S`` and the median step time (and the parameters)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from reprotrain.recipes.language_model import TinyGPT

    if way.startswith("reprotrain"):
        from reprotrain.determinism import configure_determinism

        flags = configure_determinism(0, True).trainer_flags()
    else:
        if args.device == "cpu":
            torch.set_num_threads(1)
        torch.manual_seed(0)
        flags = {"deterministic": way.endswith("det")}
    shape, batch, block, precision = SIZES[args.size]
    compiled = way != "lightning eager"
    model = TinyGPT(vocab_size=VOCAB, block_size=block, attention="sdpa", compile=compiled, **shape)
    count = batch * (1 + args.warmup + args.steps)
    tokens = torch.randint(0, VOCAB, (count, block + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    times: list[float] = []
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    class Timer(L.Callback):
        def on_train_batch_start(self, *_: object) -> None:
            sync()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_: object) -> None:
            sync()
            times.append(time.perf_counter() - self.start)

    trainer = L.Trainer(
        **flags,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        precision=precision,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer()],
    )
    trainer.fit(model, data)
    parameters = sum(p.numel() for p in model.parameters())
    print("STEP_S", json.dumps([statistics.median(times[1 + args.warmup :]), parameters]))


def run_way(way: str, args: argparse.Namespace) -> tuple[float, int]:
    me = [sys.executable, __file__, "--child", way, "--device", args.device, "--size", args.size]
    me += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    if way.startswith("reprotrain"):
        profile = ["--cpu-profile", way.split()[1]] if " " in way else []
        me = [sys.executable, "-m", "reprotrain", "run", *profile, "--", *me]
    done = subprocess.run(me, capture_output=True, text=True, check=False, env=os.environ)
    if done.returncode != 0:
        raise SystemExit(f"{way}: exit {done.returncode}\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("STEP_S "))
    step_s, parameters = json.loads(line.removeprefix("STEP_S "))
    return step_s, parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=tuple(SIZES), help="default: the device's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="steps after the compiling one")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--ways", help="comma-separated: only these (dry runs)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.size = args.size or ("gpu" if args.device == "cuda" else "cpu")
    if args.child:
        child(args.child, args)
        return
    ways = GPU_WAYS if args.device == "cuda" else CPU_WAYS
    if args.ways:
        ways = tuple(way for way in ways if way in args.ways.split(","))
    if BASE not in ways:
        parser.error(f"--ways: {BASE!r}, the base of every ratio, must be one of them")
    medians: dict[str, list[float]] = {way: [] for way in ways}
    parameters = 0
    for _ in range(args.rounds):
        for way in ways:
            step_s, parameters = run_way(way, args)
            medians[way].append(step_s)
    base = statistics.median(medians[BASE])
    shape, batch, block, precision = SIZES[args.size]
    print(
        f"TinyGPT (sdpa, {shape['n_layer']} x {shape['n_embd']}, {parameters} parameters) on "
        f"{args.device}, batch {batch} x {block}, {precision}, {args.rounds} rounds of "
        f"{args.steps} steps"
    )
    report: dict[str, object] = {"device": args.device, "size": args.size, "ways": {}}
    report |= {"parameters": parameters, "precision": precision, "base": BASE}
    for way, runs in medians.items():
        step_s = statistics.median(runs)
        rounds = ", ".join(f"{r * 1e3:.1f}" for r in runs)
        ratio = f"x{step_s / base:.3f} ({BASE})"
        print(f"  {way:24s} {step_s * 1e3:7.2f} ms  {ratio}  | rounds (ms): {rounds}")
        report["ways"][way] = {"median_step_s": step_s, "ratio": step_s / base, "rounds": runs}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
