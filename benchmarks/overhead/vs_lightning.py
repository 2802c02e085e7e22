"""Per-step cost of reprotrain's train stage against plain Lightning, on the transformer recipe.

What a user would pick instead of reprotrain is plain Lightning:
``seed_everything`` and ``Trainer(deterministic=True)``. This times a training
step of the language-model recipe (``reprotrain.recipes.language_model``:
``TinyGPT`` on ``CharCorpus``, ``pipelines/lm/params.yaml``) at two sizes,
three ways, each in a fresh process:

``lightning``
    ``L.seed_everything(seed)``, ``TinyGPT`` and a shuffled ``DataLoader`` over
    the corpus's train split, ``L.Trainer(deterministic=True)``, no CPU
    variables; torch's own kernels (AVX-512, oneDNN where the host has them).
``portable``
    reprotrain's ``train`` stage as ``dvc repro`` runs it (its ``run``: the
    recipe's checks, the environment record, the run ID, the pipeline's
    seeded loaders, checkpointing, the per-step trace at its default detail),
    ``cpu.profile: portable``, started with the profile's variables.
``native``
    The same stage with ``cpu.profile: native``.

All three train on one intra-op thread (``cpu.threads: 1``; the plain run
sets ``torch.set_num_threads(1)``): the figure is the cost per step of the
same work, not of a different thread count, and one thread is what a shared
2-core machine disturbs least. A step is the time from one training batch's
end to the next one's (data loading, forward, backward, optimizer and every
callback's per-step work), after ``--warmup`` steps; a run stops after
``--steps`` timed steps. Rounds alternate the order of the three. Printed:
the median step of each way over its rounds' medians, and each reprotrain
way's ratio to plain Lightning with a seeded 95% bootstrap interval over the
rounds (pairs: the same round). Goals (issue 31): native <= 1.05, portable
<= 1.3.

Sizes: ``1m`` (n_layer 4, n_head 4, n_embd 144, batch 32: about 1.0M
parameters) and ``20m`` (n_layer 6, n_head 8, n_embd 512, batch 8: about 19M;
a smaller batch keeps a round near two minutes on 2 cores; all of it, both
sizes, took about 15 minutes there). Block 64 tokens, dropout 0.1, AdamW, as
the recipe.

``--portable-threads N`` adds a fourth way, ``portable-Nt``: the portable stage at
``cpu.threads: N``, printed as its ratio to ``portable`` at one thread (issue 43:
two threads must beat one on a 2-core host).

    .venv/bin/python benchmarks/overhead/vs_lightning.py [--sizes 1m 20m] [--rounds 5]
        [--steps 8] [--warmup 2] [--portable-threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.child import child_env, run_json
from benchmarks._common.workloads import WORKLOADS, cpu_model
from reprotrain.atomic import atomic_write_text
from reprotrain.commands.bench import effect_pct
from reprotrain.cpu.profile import NEUTRALISED, CpuProfile
from reprotrain.hashing import canonical_json

SIZES = {
    "1m": {"n_layer": 4, "n_head": 4, "n_embd": 144, "batch_size": 32},
    "20m": {"n_layer": 6, "n_head": 8, "n_embd": 512, "batch_size": 8},
}
WAYS = ("lightning", "portable", "native")
GOALS = {"portable": 1.3, "native": 1.05}
BOOTSTRAP_SEED = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--json", type=Path, help="also write the figures here, as JSON")
    parser.add_argument("--portable-threads", type=int, help="also time portable at N threads")
    parser.add_argument("--worker", nargs=2, metavar=("WAY", "SIZE"), help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        way, size = cli.worker
        times, parameters = (plain if way == "lightning" else stage)(
            way, SIZES[size], cli.warmup, cli.steps
        )
        print(json.dumps({"step_s": times, "parameters": parameters}))
        return

    more = f" (portable-{cli.portable_threads}t: {cli.portable_threads})" * bool(
        cli.portable_threads
    )
    print(f"CPU: {cpu_model()} ({platform.machine()}), one intra-op thread{more}")
    report: dict[str, Any] = {"cpu": cpu_model(), "rounds": cli.rounds, "steps": cli.steps}
    ways = (*WAYS, f"portable-{cli.portable_threads}t") if cli.portable_threads else WAYS
    for size in cli.sizes:
        report[size] = measure(size, cli.rounds, cli.warmup, cli.steps, ways)
    if cli.json:
        atomic_write_text(cli.json, canonical_json(report))


def way_profile(way: str) -> tuple[str, int]:
    """A stage way's CPU profile and thread count: ``portable-2t`` is portable at 2 threads."""
    profile, _, threads = way.partition("-")
    return profile, int(threads.removesuffix("t") or 1)


def measure(
    size: str, rounds: int, warmup: int, steps: int, ways: tuple[str, ...] = WAYS
) -> dict[str, Any]:
    """Interleaved runs of the ways at one size; their medians and ratios, printed."""
    medians: dict[str, list[float]] = {way: [] for way in ways}
    parameters = 0
    for turn in range(rounds):
        order = ways[turn % len(ways) :] + ways[: turn % len(ways)]
        for way in order:
            result = run_worker(way, size, warmup, steps)
            medians[way].append(statistics.median(result["step_s"]))
            parameters = result["parameters"]
    spec = SIZES[size]
    print(
        f"{size}: TinyGPT n_layer {spec['n_layer']}, n_head {spec['n_head']}, n_embd "
        f"{spec['n_embd']} ({parameters:,} parameters), batch {spec['batch_size']} x 64 tokens; "
        f"{rounds} rounds of {steps} steps after {warmup}"
    )
    base = statistics.median(medians["lightning"])
    figures: dict[str, Any] = {"parameters": parameters, "median_step_s": {}, "ratio": {}}
    for way in ways:
        step = statistics.median(medians[way])
        figures["median_step_s"][way] = step
        runs = ", ".join(f"{m * 1e3:.0f}" for m in medians[way])
        line = f"  {way:9s} median step {step * 1e3:8.1f} ms"
        if way in GOALS:
            effect = effect_pct(medians[way], medians["lightning"], BOOTSTRAP_SEED)
            low, high = (1 + pct / 100 for pct in effect["ci95"])
            ratio = step / base
            verdict = "met" if high <= GOALS[way] else ("missed" if low > GOALS[way] else "unsure")
            figures["ratio"][way] = {"point": ratio, "ci95": [low, high], "goal": GOALS[way]}
            line += (
                f"  x{ratio:.3f} plain Lightning (95% CI {low:.3f}..{high:.3f}; goal "
                f"<= {GOALS[way]}: {verdict})"
            )
        if way not in WAYS:  # portable at N threads, against portable at one
            ratio = step / statistics.median(medians["portable"])
            figures["ratio"][way] = {"vs_portable_1_thread": ratio}
            line += f"  x{ratio:.3f} portable at 1 thread"
        print(f"{line}  | rounds (ms): {runs}")
    figures["rounds_median_step_s"] = medians
    return figures


def run_worker(way: str, size: str, warmup: int, steps: int) -> dict[str, Any]:
    """One timed training in a fresh process, with the CPU variables its way starts with."""
    env = child_env(profile_variables(), PYTHONHASHSEED="0")
    if way != "lightning":
        cpu = CpuProfile(*way_profile(way))
        env = {**env, **cpu.variables()}  # as the stage starts
    argv = [__file__, "--worker", way, size, "--warmup", str(warmup), "--steps", str(steps)]
    return run_json(argv, f"{way} {size}", env=env)


def profile_variables() -> set[str]:
    """Every variable either profile sets or neutralises: none leaks into another way."""
    names = {*NEUTRALISED}
    for name in ("portable", "native"):
        names |= set(CpuProfile(name).variables())
    return names


def steps_timer(warmup: int, steps: int) -> Any:
    """The step timer, batch end to batch end within an epoch; it stops the fit after
    ``warmup + steps`` of them (the imports wait for the worker: torch loads there)."""
    from benchmarks._common.step_timer import StepTimer

    return StepTimer(stop_after=warmup + steps)


def overrides(spec: dict[str, int], profile: str) -> list[str]:
    model = [f"model.init_args.{key}={spec[key]}" for key in ("n_layer", "n_head", "n_embd")]
    return [*model, f"data.init_args.batch_size={spec['batch_size']}", f"cpu.profile={profile}"]


def plain(_: str, spec: dict[str, int], warmup: int, steps: int) -> tuple[list[float], int]:
    """Worker: plain Lightning, as its docs set up a reproducible run."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from reprotrain.pipeline.params_file import load_params
    from reprotrain.recipes.language_model import CharCorpus, TinyGPT

    params = load_params(WORKLOADS["lm"], overrides(spec, "native"))
    torch.set_num_threads(1)
    L.seed_everything(params.seed, workers=True)
    data = CharCorpus(**params.data.init_args)
    data.setup("fit")
    model_args = params.model.init_args
    module = TinyGPT(data.vocab_size, data.block_size, **model_args)
    loader = DataLoader(data.train_dataset(), batch_size=spec["batch_size"], shuffle=True)
    timer = steps_timer(warmup, steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=params.train.max_epochs,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(module, loader)
    return timer.seconds[warmup:], sum(p.numel() for p in module.parameters())


def stage(profile: str, spec: dict[str, int], warmup: int, steps: int) -> tuple[list[float], int]:
    """Worker: reprotrain's train stage, its fit given the timer as one more callback."""
    from benchmarks._common.workspace import train_workspace, workload_params
    from reprotrain.pipeline import training
    from reprotrain.pipeline.stages import train

    timer, parameters = steps_timer(warmup, steps), []
    fit = training.fit

    def timed_fit(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:
            args = (*args[:4], [*args[4], timer])
        else:
            kwargs["callbacks"] = [*kwargs.get("callbacks", ()), timer]
        fitted = fit(*args, **kwargs)
        parameters.append(sum(p.numel() for p in fitted.module.parameters()))
        return fitted

    training.fit = timed_fit
    profile, threads = way_profile(profile)
    changes = [*overrides(spec, profile), f"cpu.threads={threads}"]
    with train_workspace(workload_params("lm", changes)) as (args, params):
        args.trace = args.model.with_name("trace.safetensors")  # trace on, as dvc.yaml has it
        train.run(params, args)
    return timer.seconds[warmup:], parameters[0]


if __name__ == "__main__":
    main()
