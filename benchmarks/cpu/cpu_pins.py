"""What each pin of ``cpu.profile: portable`` costs on this CPU, one pin at a time, in one run.

The portable profile is three pins on top of a fixed thread count: ATen's CPU
capability at AVX2 (``ATEN_CPU_CAPABILITY=avx2``), MKL's conditional
numerical reproducibility (``MKL_CBWR=COMPATIBLE,STRICT``) and oneDNN off
(``torch.backends.mkldnn.enabled = False``). Each variant below runs in a fresh
process (the variables only act at start-up) with one intra-op thread, times
a workload in deterministic mode, and reports the median step time and its
ratio to ``native`` (no pin). Variants alternate over rounds so drift on a
shared machine hits them alike. Workloads (``--workload``): ``conv``,
``reprotrain bench``'s (32 images of 3x32x32, four conv layers with batch norm,
SGD); ``lm``, the language-model recipe's transformer at about 1M parameters
(``benchmarks/overhead/vs_lightning.py``'s ``1m``: 4 layers, width 144, batch 32 x 64
tokens, AdamW), made of matrix products. One more variant is not a pin of the
profile: ``MKL_CBWR=AVX2,STRICT``, MKL's AVX2 branch, which Intel documents as
the same bits on every Intel CPU with AVX2 and which falls back to ``AUTO``
elsewhere; it shows what the SSE2 path of ``COMPATIBLE`` costs. Run from the
repository root::

    .venv/bin/python benchmarks/cpu/cpu_pins.py [--rounds 3] [--workload conv|lm]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.child import child_env, run_json

#: name -> (environment variables, oneDNN enabled)
VARIANTS: dict[str, tuple[dict[str, str], bool]] = {
    "native (no pin)": ({}, True),
    "ATEN_CPU_CAPABILITY=avx2 only": ({"ATEN_CPU_CAPABILITY": "avx2"}, True),
    "MKL_CBWR=COMPATIBLE,STRICT only": ({"MKL_CBWR": "COMPATIBLE,STRICT"}, True),
    "oneDNN off only": ({}, False),
    "oneDNN off + MKL_CBWR": ({"MKL_CBWR": "COMPATIBLE,STRICT"}, False),
    "portable (all three)": (
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT"},
        False,
    ),
    "portable, MKL_CBWR=AVX2,STRICT": (
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"},
        False,
    ),
}
#: The transformer at about 1M parameters (benchmarks/overhead/vs_lightning.py's "1m").
LM_1M = [
    "model.init_args.n_layer=4",
    "model.init_args.n_head=4",
    "model.init_args.n_embd=144",
    "data.init_args.batch_size=32",
]
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def measure(onednn: bool, workload: str = "conv") -> float:
    """In the child process: median step seconds of the workload."""
    import argparse as ap

    import torch

    from reprotrain.commands._steptime import conv_workload, pipeline_workload, set_mode, time_run
    from reprotrain.pipeline.params_file import load_params

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = onednn
    set_mode("deterministic")
    cpu = torch.device("cpu")
    if workload == "lm":
        params = load_params("pipelines/lm/params.yaml", LM_1M)
        setup, batches = pipeline_workload(params, None, cpu)
        return time_run(setup, batches, steps=6, warmup=2, device=cpu)
    conv = ap.Namespace(batch_size=32, image_size=32, channels=3, width=32)
    setup, batches = conv_workload(conv, cpu)
    return time_run(setup, batches, steps=10, warmup=3, device=cpu)


def run_variant(name: str, workload: str) -> float:
    variables, onednn = VARIANTS[name]
    env = child_env(("ATEN_CPU_CAPABILITY", "MKL_CBWR"), **THREADS, **variables)
    code = f"from benchmarks.cpu.cpu_pins import measure; print(measure({onednn}, {workload!r}))"
    return float(run_json(["-c", code], name, env=env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", choices=("conv", "lm"), default="conv")
    args = parser.parse_args()
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            times[name].append(run_variant(name, args.workload))
    base = statistics.median(times[names[0]])
    print(
        f"{args.workload} workload, 1 thread, median step over {args.rounds} rounds "
        "(fresh process each)"
    )
    for name in names:
        step = statistics.median(times[name])
        print(f"  {name:34s} {step:.4f} s  {step / base:.2f}x native")


if __name__ == "__main__":
    main()
