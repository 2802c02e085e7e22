"""World-size invariant mode against plain DDP: optimizer-step time at 2 CPU processes.

Prepares the default data once, then alternates fresh trainings of the
pipeline model at 2 gloo processes and the same global batch: plain DDP
(batch B/2 per rank, one all-reduce) and ``train.world_size_invariant``
with micro-batches of B/2 (one per rank and step) and of B/4 (two). Each
training times its optimizer steps on rank 0 after a warm-up epoch (epoch
time / steps) and prints the median; this prints the medians over the
repeats and each mode's ratio to plain DDP, on the default model and on one
whose hidden layer makes it about 10M parameters.

    .venv/bin/python benchmarks/invariant_overhead.py [--repeats 3] [--epochs 3]
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

#: hidden width for ~10M parameters (512 x 19500 + 19500 x 10 weights).
HIDDEN_10M = 19500


class StepTimer(L.Callback):
    """Seconds per optimizer step of every epoch after the first (rank 0 reports)."""

    def __init__(self) -> None:
        self.per_step: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start, self._steps = time.perf_counter(), trainer.global_step

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch > 0:
            steps = trainer.global_step - self._steps
            self.per_step.append((time.perf_counter() - self._start) / steps)


def _train_once(data: Path, overrides: list[str]) -> None:
    """One training; Lightning starts the other rank by rerunning this script."""
    from reprotrain.determinism import configure_determinism
    from reprotrain.distributed import set_threads_per_rank, this_rank
    from reprotrain.pipeline.config import load_params
    from reprotrain.pipeline.data import load_prepared
    from reprotrain.pipeline.stages import train

    params = load_params(ROOT / "params.yaml", overrides)
    settings = configure_determinism(params.seed, params.deterministic)
    set_threads_per_rank(params.train.devices)
    timer = StepTimer()
    train.fit(params, load_prepared(data), settings, extra_callbacks=[timer])
    if this_rank() == 0:
        print(json.dumps({"step_s": statistics.median(timer.per_step)}))


def _timed_run(data: Path, overrides: list[str]) -> float:
    argv = [sys.executable, __file__, "--train", str(data), *(f"--set={o}" for o in overrides)]
    env = cli_env(PYTHONHASHSEED="0")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"training {overrides} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="the first is warm-up")
    parser.add_argument("--batch", type=int, default=64, help="global batch (divisible by 4)")
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.train is not None:  # a worker (or the rank Lightning started)
        _train_once(cli.train, cli.set)
        return
    common = ["train.strategy=ddp", "train.devices=2", f"train.max_epochs={cli.epochs}"]
    common += [f"data.batch_size={cli.batch}"]
    modes = {
        "plain DDP": [],
        f"invariant, micro {cli.batch // 2}": [
            "train.world_size_invariant=true",
            f"train.micro_batch_size={cli.batch // 2}",
        ],
        f"invariant, micro {cli.batch // 4}": [
            "train.world_size_invariant=true",
            f"train.micro_batch_size={cli.batch // 4}",
        ],
    }
    models = {"default model": [], "~10M-parameter model": [f"model.hidden={HIDDEN_10M}"]}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.safetensors"
        prepare = [sys.executable, "-m", "reprotrain", "prepare", "--raw-dir", tmp, "--out", data]
        subprocess.run(prepare, cwd=ROOT, env=cli_env(), check=True, capture_output=True)
        times = {(m, k): [] for m in models for k in modes}
        for _ in range(cli.repeats):
            for model, model_set in models.items():
                for mode, mode_set in modes.items():
                    step = _timed_run(data, [*common, *model_set, *mode_set])
                    times[(model, mode)].append(step)
    print(f"2 gloo processes, global batch {cli.batch}, {cli.repeats} interleaved fresh trainings")
    for model in models:
        base = statistics.median(times[(model, "plain DDP")])
        print(f"  {model}:")
        for mode in modes:
            median = statistics.median(times[(model, mode)])
            each = ", ".join(f"{1000 * t:.1f}" for t in times[(model, mode)])
            print(
                f"    {mode:22s} median step {1000 * median:8.2f} ms  "
                f"ratio to plain DDP {median / base:.2f}  (runs {each})"
            )


if __name__ == "__main__":
    main()
