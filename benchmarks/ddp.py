"""DDP on CPU: step time of 2 gloo processes against 1 process, on the same global batch.

Prepares the default data once, then alternates fresh trainings of the
pipeline model: ``strategy: ddp`` with 1 process (batch B) and with 2
processes (batch B/2 each, so the same B samples per optimizer step). Each
training times its steps on rank 0 after a warm-up epoch and prints the
median; this prints the medians over the repeats and the ratio (2 processes
/ 1 process: above 1 means slower). On the 2-core build machine little
speed-up is possible: the point is the overhead of the path (all-reduce,
two interpreters on two cores), measured.

    .venv/bin/python benchmarks/ddp.py [--repeats 3] [--epochs 4] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.helpers import cli_env  # noqa: E402


class StepTimer(L.Callback):
    """Wall time of every training step after the first epoch (rank 0 reports)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch > 0:
            self.times.append(time.perf_counter() - self._start)


def _train_once(data: Path, devices: int, batch: int, epochs: int) -> None:
    """One training; Lightning starts the other ranks by rerunning this script."""
    from reprotrain.determinism import configure_determinism
    from reprotrain.distributed import set_threads_per_rank, this_rank
    from reprotrain.pipeline.config import load_params
    from reprotrain.pipeline.data import load_prepared
    from reprotrain.pipeline.stages import train

    overrides = ["train.strategy=ddp", f"train.devices={devices}", f"train.max_epochs={epochs}"]
    params = load_params(ROOT / "params.yaml", [*overrides, f"data.batch_size={batch}"])
    settings = configure_determinism(params.seed, params.deterministic)
    threads = set_threads_per_rank(devices)
    timer = StepTimer()
    train.fit(params, load_prepared(data), settings, extra_callbacks=[timer])
    if this_rank() == 0:
        median = statistics.median(timer.times)
        print(json.dumps({"step_s": median, "steps": len(timer.times), "threads": threads}))


def _timed_run(data: Path, devices: int, batch: int, epochs: int) -> dict:
    argv = [sys.executable, __file__, "--train", str(data), "--devices", str(devices)]
    argv += ["--batch", str(batch), "--epochs", str(epochs)]
    done = subprocess.run(
        argv, env=cli_env(PYTHONHASHSEED="0"), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"training with {devices} process(es) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="the first is warm-up")
    parser.add_argument("--batch", type=int, default=64, help="global batch (even)")
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.train is not None:  # a worker (or a rank Lightning started)
        _train_once(cli.train, cli.devices, cli.batch, cli.epochs)
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.safetensors"
        prepare = [sys.executable, "-m", "reprotrain", "prepare", "--raw-dir", tmp, "--out", data]
        subprocess.run(prepare, cwd=ROOT, env=cli_env(), check=True, capture_output=True)
        layouts = {"1 process": (1, cli.batch), "2 processes": (2, cli.batch // 2)}
        results: dict[str, list[dict]] = {name: [] for name in layouts}
        for _ in range(cli.repeats):
            for name, (devices, batch) in layouts.items():
                results[name].append(_timed_run(data, devices, batch, cli.epochs))
    print(f"global batch {cli.batch}, {cli.repeats} interleaved fresh trainings each, gloo on CPU")
    medians = {}
    for name, runs in results.items():
        medians[name] = statistics.median(r["step_s"] for r in runs)
        each = ", ".join(f"{1000 * r['step_s']:.2f}" for r in runs)
        per_rank = layouts[name][1]
        print(
            f"  {name:11s} batch {per_rank:3d} per rank, {runs[0]['threads']} thread(s) each: "
            f"median step {1000 * medians[name]:.2f} ms (runs {each})"
        )
    ratio = medians["2 processes"] / medians["1 process"]
    print(f"  step time, 2 processes / 1 process = {ratio:.2f}")


if __name__ == "__main__":
    main()
