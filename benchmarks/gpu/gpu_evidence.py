"""GPU evidence in one call, on a bare GPU host: twin runs, noise floor, cost, ops, DDP, trace.

Made for a short, lent GPU window on a host we did not set up (its own torch,
no DVC, no network): run from the repository root with the host's packages,

    make gpu-evidence            # = PYTHONPATH=src python3 benchmarks/gpu/gpu_evidence.py

and commit what it writes into ``docs/gpu/<GPU model>/`` (``h100``, ``h200``:
one folder per model; ``benchmarks/gpu/gpu_rows.py`` then fills the docs' rows
from them). Each step runs in fresh processes through the real ``reprotrain``
CLI (``python -m reprotrain``) and writes one JSON file, ``<step>.json``;
``summary.json`` and ``summary.md`` hold the device, driver, CUDA, cuDNN and
torch build, every difference from the lock, and one headline per step. The
steps, in order of value, within ``--budget-s`` (a step that would start after
it is recorded as skipped):

* ``twin_deterministic``: the train stage twice, ``deterministic: true``, on
  the workload (``--workload``: the language-model transformer by default,
  ``digits`` for the CNN); are model, trace and metrics bit-identical? Every
  twin step records each run's run ID and the sha256 of its model, trace and
  metrics, so two GPU models' evidence says whether they trained the same bits.
* ``noise_floor``: the same with ``deterministic: false``: how far they drift
  (max weight difference, first diverging step).
* ``bench``: ``reprotrain bench`` on a GPU-sized conv workload: the cost of
  determinism in % with its 95% interval.
* ``twin_compiled``: the train stage twice on pipelines/lm-compiled (SDPA,
  ``bf16-mixed``, ``torch.compile``) at a GPU size (:data:`COMPILED_SIZES`: 8 layers,
  width 512, 128 tokens x 32, 25.3M parameters).
* ``compile``: ``benchmarks/overhead/compile_speed.py``: a compiled Lightning step, plain
  eager, compiled with ``deterministic`` false and true, and reprotrain's: what
  determinism costs compiled.
* ``settings``: ``benchmarks/gpu/determinism_settings.py``: what each determinism
  setting costs alone and together (conv and the transformer at a GPU size),
  and which of them change the bits here.
* ``ops``: ``reprotrain ops``: which ops have non-deterministic default paths
  here, and what determinism does to them (``ops.md`` too).
* ``ddp_twin``: the 1-GPU DDP path (``strategy: ddp, devices: 1``) twice.
* ``trace_overhead``: ``benchmarks/overhead/trace_overhead.py`` on this device and workload.
* ``pytest_gpu``: ``pytest -m gpu``, counts of passed / failed / skipped.
* ``docker``: ``docker run --gpus all`` of the image twice, where the host has a
  Docker engine, the NVIDIA runtime and the image; otherwise it says which is missing.

Evidence mode: the host's packages are not our lock's, and ``deterministic:
true`` refuses lock drift. The train runs here pass ``--evidence``, which
records the drift instead (printed by the stage; in its environment record,
so in its run ID). Every output names the device and carries the drift; the
pipeline (dvc.yaml) never passes ``--evidence`` and stays fail-closed.

``--device cpu --quick --out DIR`` is the dry run that ``make test`` does
(tests/test_gpu_evidence.py), so the script cannot rot while no GPU is around.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.workloads import WORKLOADS

SCHEMA = "reprotrain.gpu_evidence/1"
STEPS = (
    "twin_deterministic",
    "noise_floor",
    "twin_compiled",
    "compile",
    "bench",
    "settings",
    "ops",
    "ddp_twin",
    "trace_overhead",
    "pytest_gpu",
    "docker",
)
RUN_FILES = ("model.safetensors", "trace.safetensors", "metrics.json")
#: (full, quick) sizes. Full: what a GPU needs for real work, inside ~8 minutes.
EPOCHS = (3, 1)
BENCH = (
    [
        "--batch-size",
        "256",
        "--image-size",
        "64",
        "--width",
        "64",
        "--steps",
        "50",
        "--repeats",
        "10",
    ],
    ["--batch-size", "8", "--image-size", "16", "--width", "8", "--steps", "3", "--repeats", "2"],
)
OPS = ([], ["--only", "Tensor.index_add_", "--repeats", "2"])
SETTINGS = (
    ["--rounds", "3", "--passes", "1", "--steps", "15", "--profile"],
    ["--quick", "--rounds", "2", "--workloads", "conv"],
)
COMPILE = (
    ["--device", "cuda", "--rounds", "3", "--steps", "30"],
    [
        *("--device", "cpu", "--size", "tiny", "--rounds", "1", "--steps", "1", "--warmup", "0"),
        *("--ways", "lightning compiled,reprotrain portable"),
    ],
)
COMPILED = ROOT / "pipelines" / "lm-compiled" / "params.yaml"
#: (full, quick): pipelines/lm-compiled at the size a GPU trains (25.3M parameters); the
#: dry run's: one small block, the least Inductor builds.
COMPILED_SIZES = (
    [
        *("model.init_args.n_layer=8", "model.init_args.n_head=8", "model.init_args.n_embd=512"),
        *("data.init_args.block_size=128", "data.init_args.batch_size=32"),
    ],
    ["model.init_args.n_layer=1", "model.init_args.n_embd=16", "data.init_args.block_size=16"],
)
TRACE = (
    ["--repeats", "3", "--epochs", "2", "--mlp-steps", "128"],
    ["--repeats", "1", "--epochs", "1", "--mlp-steps", "0", "--steps", "8"],
)


class Evidence:
    """The workspace, the device facts, and the steps' outputs."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        """``args.out`` None: the GPU model's folder under docs/gpu/ (:func:`device_folder`)."""
        self.quick = int(args.quick)
        self.accelerator = "gpu" if args.device == "cuda" else "cpu"
        self.env = {**os.environ, "PYTHONPATH": _pythonpath(), "CI": "1"}
        self.facts = device_facts(args.device, args.lock)
        if args.out is None:
            args.out = ROOT / "docs" / "gpu" / device_folder(self.facts)
        args.out.mkdir(parents=True, exist_ok=True)
        self.args, self.work, self.out = args, work, args.out
        self.started = time.monotonic()

    def cli(self, *argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "reprotrain", *map(str, argv)]
        return _run(cmd, cwd or self.work, self.env)

    def train(self, name: str, *overrides: str, recipe: str = "") -> Path:
        """One train-stage run in a fresh process; its folder. ``recipe``: ``compiled``
        trains pipelines/lm-compiled (params and env record ``compiled-``), else the
        workload's."""
        run = self.work / name
        run.mkdir()
        sets = [f"train.accelerator={self.accelerator}", f"train.max_epochs={EPOCHS[self.quick]}"]
        prefix = f"{recipe}-" if recipe else ""
        data = self.work / "data.safetensors"
        if data.exists() and not recipe:  # a recipe with a prepare step
            # The data module reads what data.init_args.path names; --data only hashes the file.
            sets.append(f"data.init_args.path={data}")
        if self.quick:
            sets.append("data.init_args.num_workers=0")
        result = self.cli(
            "train",
            *("--params", self.work / f"{prefix}params.yaml"),
            *(("--data", data) if data.exists() and not recipe else ()),
            *("--env", self.work / f"{prefix}env.json"),
            *("--model", run / "model.safetensors", "--metrics", run / "metrics.json"),
            *("--plots", run / "plots", "--run-record", run / "run.json"),
            *("--checkpoints", run / "ckpt", "--trace", run / "trace.safetensors"),
            "--evidence",
            *(arg for s in [*sets, *overrides] for arg in ("-S", s)),
        )
        _check(result, f"train {name}")
        return run

    def twin(self, name: str, *overrides: str, recipe: str = "") -> dict[str, Any]:
        a = self.train(f"{name}-1", *overrides, recipe=recipe)
        b = self.train(f"{name}-2", *overrides, recipe=recipe)
        return compare_runs(a, b)

    def twin_compiled(self) -> dict[str, Any]:
        """pipelines/lm-compiled twice, deterministic, at a GPU's size (the dry run: its own)."""
        shutil.copy(COMPILED, self.work / "compiled-params.yaml")
        env = self.cli("env", "--params", "compiled-params.yaml", "--lock", self.args.lock,
                       "--out", "compiled-env.json")  # fmt: skip
        _check(env, "env (pipelines/lm-compiled)")
        sizes = COMPILED_SIZES[self.quick]
        return self.twin("compiled", "deterministic=true", *sizes, recipe="compiled")

    def record(self, step: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one step within the budget; write ``<step>.json`` whatever happens."""
        entry: dict[str, Any] = {
            "schema": SCHEMA,
            "step": step,
            **self.stamp(),
            "command": _command_line(),
        }
        began = time.monotonic()
        if began - self.started > self.args.budget_s:
            entry |= {"status": "skipped", "reason": f"time budget ({self.args.budget_s} s) spent"}
        elif step in self.args.skip:
            entry |= {"status": "skipped", "reason": "--skip"}
        else:
            try:
                entry |= {"status": "ok", "result": run()}
            except StepError as err:
                entry |= {"status": "failed", "error": str(err)}
        entry["seconds"] = round(time.monotonic() - began, 1)
        write_json(self.out / f"{step}.json", entry)
        print(f"gpu-evidence: {step}: {entry['status']} ({entry['seconds']} s)", flush=True)
        return entry

    def kept(self, step: str) -> dict[str, Any] | None:
        """With ``--rerun``: a step not named keeps its earlier output from this device model.

        A lent GPU window is short: a failed step is fixed and run again alone,
        the others stay as measured (each output carries its own command).
        """
        if not self.args.rerun or step in self.args.rerun:
            return None
        path = self.out / f"{step}.json"
        earlier = read_json(path) if path.is_file() else None
        same = earlier is not None and all(
            earlier.get(key) == value
            for key, value in self.stamp().items()
            if key in ("device", "device_name", "workload")
        )
        if not same:
            raise SystemExit(
                f"gpu-evidence: --rerun: {path} holds no earlier output of {step} on "
                f"{self.facts['device_name']} ({self.args.workload}); run every step"
            )
        if "command" not in earlier:  # written before steps named their command
            earlier["command"] = read_json(self.out / "summary.json")["command"]
        print(f"gpu-evidence: {step}: kept from `{earlier['command']}`", flush=True)
        return {**earlier, "kept": True}

    def stamp(self) -> dict[str, Any]:
        """What every output carries: the device and the drift from the lock."""
        return {
            "device": self.args.device,
            "device_name": self.facts["device_name"],
            "workload": self.args.workload,
            "evidence_mode": True,
            "lock": self.facts["lock"]["file"],
            "lock_drift": self.facts["lock"]["drift"],
        }


class StepError(Exception):
    """A step's command failed; the message holds the end of its output."""


def _command_line() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


def _pythonpath() -> str:
    parts = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def _check(result: subprocess.CompletedProcess, what: str, ok: tuple[int, ...] = (0,)) -> None:
    if result.returncode not in ok:
        tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
        raise StepError(f"{what}: exit {result.returncode}: " + " | ".join(tail))


def device_facts(device: str, lock: Path) -> dict[str, Any]:
    """GPU model, driver, CUDA, cuDNN, torch build, and the drift from ``lock``."""
    import torch

    from reprotrain.provenance.environment import lock_status

    facts: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "lock": lock_status(lock, ignore_packages=("reprotrain",)),
    }
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "gpu-evidence: --device cuda: no CUDA device visible; use --device cpu"
            )
        props = torch.cuda.get_device_properties(0)
        facts |= {
            "device_name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "gpu_count": torch.cuda.device_count(),
            "driver": _nvidia_smi("driver_version"),
        }
    else:
        facts |= {"device_name": facts["cpu"], "threads": torch.get_num_threads()}
    facts["lock"] = {"file": str(lock), **{k: facts["lock"][k] for k in ("exact", "drift")}}
    return facts


def device_folder(facts: dict[str, Any]) -> str:
    """The evidence folder's name for a device: ``NVIDIA H100 80GB HBM3`` -> ``h100``."""
    words = facts["device_name"].replace("NVIDIA", "").split()
    return re.sub(r"[^a-z0-9.-]", "", words[0].lower()) if words else "gpu"


def _nvidia_smi(field: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    result = subprocess.run(
        ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 else None


def compare_runs(a: Path, b: Path) -> dict[str, Any]:
    """Bitwise equality of two runs' files; on a difference, by how much and where first."""
    from reprotrain.compare.weights import compare_weights
    from reprotrain.hashing import load_safetensors, sha256_file
    from reprotrain.trace.diff import compare_traces
    from reprotrain.trace.tracefile import load_trace

    equal = {name: sha256_file(a / name) == sha256_file(b / name) for name in RUN_FILES}
    weights = compare_weights(
        load_safetensors(a / "model.safetensors")[0], load_safetensors(b / "model.safetensors")[0]
    )
    diff = compare_traces(load_trace(a / "trace.safetensors"), load_trace(b / "trace.safetensors"))
    return {
        "identical": all(equal.values()),
        "runs": [run_digests(run) for run in (a, b)],
        "files_equal": equal,
        "max_abs_weight_diff": max((d.max_abs_diff or 0.0) for d in weights),
        "tensors_different": sum(not d.equal for d in weights),
        "first_diverging_step": diff.to_dict().get("first_step"),
        "trace": diff.to_text(),
    }


def run_digests(run: Path) -> dict[str, Any]:
    """What names a run's bits across hosts and GPU models: its run ID, its files' sha256."""
    from reprotrain.hashing import sha256_file

    record = run / "run.json"
    return {
        "run_id": read_json(record)["run_id"] if record.is_file() else None,
        **{f"{name.split('.')[0]}_sha256": sha256_file(run / name) for name in RUN_FILES},
    }


def step_settings(ev: Evidence) -> dict[str, Any]:
    raw = ev.work / "settings.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu" / "determinism_settings.py"),
        *SETTINGS[ev.quick],
    ]
    cmd += ["--device", ev.args.device, "--json", str(raw)]
    _check(_run(cmd, ROOT, ev.env), "benchmarks/gpu/determinism_settings.py")
    return read_json(raw)


def step_compile(ev: Evidence) -> dict[str, Any]:
    raw = ev.work / "compile.json"
    script = ROOT / "benchmarks" / "overhead" / "compile_speed.py"
    cmd = [sys.executable, str(script), *COMPILE[ev.quick], "--json", str(raw)]
    _check(_run(cmd, ROOT, ev.env), "benchmarks/overhead/compile_speed.py")
    return read_json(raw)


def step_bench(ev: Evidence) -> dict[str, Any]:
    raw = ev.work / "bench.json"
    sizes = BENCH[ev.quick]
    result = ev.cli(
        "bench", "--device", ev.args.device, "--workload", "conv", *sizes, "--out", raw,
    )  # fmt: skip
    _check(result, "reprotrain bench")
    return read_json(raw)


def step_ops(ev: Evidence) -> dict[str, Any]:
    raw = ev.work / "ops.json"
    result = ev.cli(
        "ops", "--device", ev.args.device, *OPS[ev.quick],
        "--out-md", ev.out / "ops.md", "--out-json", raw,
    )  # fmt: skip
    _check(result, "reprotrain ops", ok=(0, 1))
    return read_json(raw)


def step_trace_overhead(ev: Evidence) -> dict[str, Any]:
    raw = ev.work / "trace_overhead.json"
    script = ROOT / "benchmarks" / "overhead" / "trace_overhead.py"
    cmd = [sys.executable, str(script), *TRACE[ev.quick]]
    cmd += ["--accelerator", ev.accelerator, "--json", str(raw), "--workload", ev.args.workload]
    _check(_run(cmd, ROOT, ev.env), "benchmarks/overhead/trace_overhead.py")
    return read_json(raw)


def step_pytest_gpu(ev: Evidence) -> dict[str, Any]:
    junit = ev.work / "pytest-gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    # The GPU tests are processes, mostly: four at once on a GPU host. The CPU dry run
    # (--quick) only sees them skip, and four workers importing the suite would cost it
    # more than the tests themselves.
    if importlib.util.find_spec("xdist") is not None and not ev.quick:
        cmd += ["-n", "4"]
    result = _run([*cmd, f"--junitxml={junit}"], ROOT, ev.env)
    _check(result, "pytest -m gpu", ok=(0, 1, 5))
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        case.get("classname", "") + "::" + case.get("name", "")
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "passed": passed, "failed_tests": failed, "exit_code": result.returncode}


def step_docker(ev: Evidence) -> dict[str, Any]:
    """Two runs of the pipeline in the image with --gpus all, compared; or what is missing."""
    if ev.args.device != "cuda":
        return {"ran": False, "reason": "--device cpu: the GPU container check needs a GPU"}
    if shutil.which("docker") is None:
        return {"ran": False, "reason": "no docker client on this host"}
    runtimes = _run(["docker", "info", "--format", "{{json .Runtimes}}"], ROOT, ev.env)
    if runtimes.returncode != 0:
        return {"ran": False, "reason": "no Docker engine answers (docker info fails)"}
    if "nvidia" not in runtimes.stdout:
        return {"ran": False, "reason": "the Docker engine has no NVIDIA runtime"}
    if _run(["docker", "image", "inspect", ev.args.image], ROOT, ev.env).returncode != 0:
        return {"ran": False, "reason": f"no image {ev.args.image} (no registry to pull from)"}
    runs = []
    for index in (1, 2):
        folder = Path(shutil.copytree(ROOT, ev.work / f"docker-{index}", ignore=_ignored))
        cmd = ["docker", "run", "--rm", "--gpus", "all", "--user", f"{os.getuid()}:{os.getgid()}"]
        cmd += ["-v", f"{folder}:/workspace", ev.args.image, "dvc", "repro", "-S"]
        cmd += ["train.accelerator=gpu"]
        _check(_run(cmd, folder, ev.env), f"docker run {index}")
        runs.append(folder)
    return {"ran": True, **compare_runs(*(f / "models" for f in runs))}


def _ignored(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n in (".venv", ".git", "checkpoints", "__pycache__")]


def twin_difference(result: dict[str, Any]) -> str:
    """How two runs of a twin step differ: the largest weight difference, the first step."""
    return (
        f"max |weight diff| {result['max_abs_weight_diff']:.3g}, "
        f"first diverging step {result['first_diverging_step']}"
    )


def determinism_cost(bench: dict[str, Any]) -> str:
    """The conv workload's determinism cost with its 95% interval, from ``bench``'s report."""
    cost = bench["workloads"]["conv"]["determinism_cost"]
    low, high = cost["ci95"]
    return f"{cost['pct']:+.1f}% (95% CI {low:+.1f} .. {high:+.1f})"


#: The settings step's effect that is what ``deterministic: true`` sets now (the four
#: settings, torch's fill of fresh tensors off), against torch's defaults.
LIBRARY_EFFECT = "all but fill_uninitialized_memory"


def settings_cost(settings: dict[str, Any], workload: str, effect: str = LIBRARY_EFFECT) -> str:
    """One effect of ``determinism_settings``'s report with its 95% interval."""
    cost = settings["workloads"][workload]["effects"][effect]
    low, high = cost["ci95"]
    return f"{cost['pct']:+.1f}% (95% CI {low:+.1f} .. {high:+.1f})"


def not_repeatable(ops: dict[str, Any]) -> list[str]:
    """The ops whose default mode gave different bits on repeated calls."""
    return [op["name"] for op in ops["ops"] if op["default"] == "differs"]


def trace_ratios(trace: dict[str, Any]) -> str:
    """Step time with the default trace over tracing off, per model."""
    return "; ".join(
        f"{m['model'].split(' (')[0]} x{m['ratio_to_off']['default']:.3f}" for m in trace["models"]
    )


def headline(step: str, entry: dict[str, Any]) -> str:
    """One line per step for the summary."""
    if entry["status"] != "ok":
        return f"{entry['status']}: {entry.get('reason') or entry.get('error', '')}"[:300]
    result = entry["result"]
    if step in ("twin_deterministic", "noise_floor", "twin_compiled", "ddp_twin"):
        if result["identical"]:
            return "bit-identical (model, trace, metrics)"
        return f"differ: {twin_difference(result)}"
    if step == "bench":
        return f"determinism cost {determinism_cost(result)}"
    if step == "compile":
        ways = result["ways"]
        return (
            "; ".join(f"{way} x{ways[way]['ratio']:.3f}" for way in ways) + f" of {result['base']}"
        )
    if step == "settings":
        return "; ".join(
            f"{name}: deterministic: true {settings_cost(result, name)}"
            for name in result["workloads"]
        )
    if step == "ops":
        alerts = not_repeatable(result)
        return f"{len(result['ops'])} ops probed; not repeatable by default: {alerts or 'none'}"
    if step == "trace_overhead":
        return f"default trace vs off: {trace_ratios(result)}"
    if step == "pytest_gpu":
        return (
            f"{result['passed']} passed, {result['failures'] + result['errors']} failed, "
            f"{result['skipped']} skipped"
        )
    if step == "docker":
        if not result["ran"]:
            return f"not run: {result['reason']}"
        return "bit-identical" if result["identical"] else "differ"
    return "ok"


def write_summary(ev: Evidence, entries: dict[str, dict[str, Any]]) -> None:
    summary = {
        "schema": SCHEMA,
        **ev.stamp(),
        "facts": ev.facts,
        "command": _command_line(),
        "steps": {
            step: {
                "status": e["status"],
                "seconds": e["seconds"],
                "headline": headline(step, e),
                "command": e["command"],
            }
            for step, e in entries.items()
        },
    }
    kept = sorted({e["command"] for e in entries.values() if e.get("kept")})
    write_json(ev.out / "summary.json", summary)
    facts = ev.facts
    lines = [
        f"# GPU evidence: {facts['device_name']}",
        "",
        f"`{summary['command']}`; device `{ev.args.device}`, torch {facts['torch']}, "
        f"CUDA {facts['cuda']}, cuDNN {facts['cudnn']}, driver {facts.get('driver')}, "
        f"compute capability {facts.get('compute_capability')}, Python {facts['python']}.",
        "",
        f"Evidence mode: differences from `{facts['lock']['file']}` "
        f"({len(facts['lock']['drift'])}), recorded instead of refused:",
        "",
        *(
            f"- {d['package']}: installed {d['installed']}, lock {d['locked']}"
            for d in facts["lock"]["drift"]
        ),
        "",
        "| step | status | seconds | result |",
        "| --- | --- | --- | --- |",
        *(
            f"| {step} | {s['status']}{', kept' * entries[step].get('kept', False)} "
            f"| {s['seconds']} | {s['headline'].replace('|', '/')} |"
            for step, s in summary["steps"].items()
        ),
        "",
        *(f"Kept (`--rerun` named other steps) from an earlier call: `{c}`." for c in kept),
        "",
    ]
    (ev.out / "summary.md").write_text("\n".join(lines))


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def write_json(path: Path, value: dict[str, Any]) -> None:
    from reprotrain.atomic import atomic_write_text
    from reprotrain.hashing import canonical_json

    atomic_write_text(path, canonical_json(value))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--out", type=Path, help="default: docs/gpu/<GPU model>/, e.g. docs/gpu/h200/"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    parser.add_argument("--lock", type=Path, help="lock to compare against (default by device)")
    parser.add_argument("--budget-s", type=float, default=420, help="start no step after this")
    parser.add_argument("--skip", action="append", default=[], choices=STEPS, metavar="STEP")
    parser.add_argument(
        "--rerun",
        action="append",
        default=[],
        choices=STEPS,
        metavar="STEP",
        help="run only these steps; keep the others' outputs in --out (same device model)",
    )
    parser.add_argument("--image", default="reprotrain:latest", help="image for the docker step")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temp folder)")
    parser.add_argument(
        "--workload", choices=tuple(WORKLOADS), default="lm", help="the recipe trained"
    )
    args = parser.parse_args(argv)
    args.lock = args.lock or ROOT / (
        "requirements.lock" if args.device == "cuda" else "requirements-cpu.lock"
    )
    with contextlib.ExitStack() as stack:
        if args.work is None:
            args.work = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-evidence-"))
            )
        args.work.mkdir(parents=True, exist_ok=True)
        ev = Evidence(args, args.work)
        shutil.copy(WORKLOADS[args.workload], ev.work / "params.yaml")
        if args.workload == "digits":  # the one recipe with a prepare step
            (ev.work / "raw").mkdir()
            _check(ev.cli("prepare", "--raw-dir", "raw", "--out", "data.safetensors"), "prepare")
        _check(ev.cli("env", "--lock", args.lock, "--out", "env.json"), "env")
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "twin_deterministic": lambda: ev.twin("det", "deterministic=true"),
            "noise_floor": lambda: ev.twin("fast", "deterministic=false"),
            "twin_compiled": ev.twin_compiled,
            "compile": lambda: step_compile(ev),
            "bench": lambda: step_bench(ev),
            "settings": lambda: step_settings(ev),
            "ops": lambda: step_ops(ev),
            "ddp_twin": lambda: ev.twin(
                "ddp", "deterministic=true", "train.strategy=ddp", "train.devices=1"
            ),
            "trace_overhead": lambda: step_trace_overhead(ev),
            "pytest_gpu": lambda: step_pytest_gpu(ev),
            "docker": lambda: step_docker(ev),
        }
        kept = {step: ev.kept(step) for step in STEPS}  # all checked before any step runs
        entries = {step: kept[step] or ev.record(step, steps[step]) for step in STEPS}
        write_summary(ev, entries)
    print(f"gpu-evidence: wrote {args.out}/summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
