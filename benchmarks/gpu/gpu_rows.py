"""The docs' GPU rows, generated from the raw outputs of ``make gpu-evidence`` in docs/gpu/.

Each GPU model's evidence is a folder, ``docs/gpu/<model>/`` (:data:`FOLDERS`,
newest first): a row comes from the first folder whose step measured it, and
names that GPU. Each generated block sits between ``<!-- gpu-rows:NAME -->``
and ``<!-- /gpu-rows:NAME -->`` in README.md, docs/lab.md, docs/scaling-out.md
or docs/gpu/README.md (``models``: every folder's twin runs side by side, with
their weights' sha256 and run IDs where the run recorded them). While no folder
holds a GPU run every row says "not yet measured"; outputs of a CPU dry run
never count as GPU evidence. tests/test_gpu_evidence.py runs ``--check``, so
the docs cannot drift from the committed outputs.

    python benchmarks/gpu/gpu_rows.py            # rewrite the blocks
    python benchmarks/gpu/gpu_rows.py --check    # exit 1 if a block is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks.gpu.gpu_evidence import (
    determinism_cost,
    not_repeatable,
    settings_cost,
    trace_ratios,
    twin_difference,
)

GPU_DOCS = ROOT / "docs" / "gpu"
#: The evidence folders under docs/gpu/, newest first; with the shared raw outputs of an
#: H200 run of b7c9b1e (no summary, no digests), listed in the models table only.
FOLDERS = ("h200", "h100")
SHARED = ("h200-b7c9b1e",)
DOCS = {
    "tradeoff": ROOT / "README.md",
    "lab": ROOT / "docs" / "lab.md",
    "ddp": ROOT / "docs" / "scaling-out.md",
    "models": GPU_DOCS / "README.md",
}
OWED = "not yet measured"
SOURCE = "`make gpu-evidence` ([docs/gpu/{folder}/summary.md]({up}gpu/{folder}/summary.md))"


def load_evidence(folder: Path) -> dict[str, Any] | None:
    """The summary and every step's output, or None while there is no GPU run."""
    summary_path = folder / "summary.json"
    if not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    if summary.get("device") != "cuda":
        return None
    steps = {
        step: json.loads((folder / f"{step}.json").read_text())
        for step in summary["steps"]
        if (folder / f"{step}.json").is_file()
    }
    return {"summary": summary, "steps": steps, "folder": folder.name}


Evidence = dict[str, Any] | list[dict[str, Any]] | None


def _runs(evidence: Evidence) -> list[dict[str, Any]]:
    if evidence is None:
        return []
    return evidence if isinstance(evidence, list) else [evidence]


def _measured(evidence: Evidence, step: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The first run (newest first) whose ``step`` is ok: (its result, the run)."""
    for run in _runs(evidence):
        entry = run["steps"].get(step)
        if entry and entry["status"] == "ok":
            return entry["result"], run
    return None, None


def _result(evidence: Evidence, step: str) -> dict[str, Any] | None:
    return _measured(evidence, step)[0]


def _twin(result: dict[str, Any] | None) -> str:
    if result is None:
        return OWED
    return "yes, 2 of 2" if result["identical"] else f"no: {twin_difference(result)}"


def _where(evidence: Evidence, step: str, up: str) -> str:
    run = _measured(evidence, step)[1]
    if run is None:
        return ""
    name = run["summary"]["device_name"]
    return f"{name}: " + SOURCE.format(up=up, folder=run.get("folder", "."))


def _costs(evidence: Evidence) -> tuple[str, str, str, str]:
    """(conv cost, its source, transformer cost, its source): the settings step's full
    set vs torch's defaults, else (conv only) the bench step's."""
    settings = _result(evidence, "settings")
    if settings is not None:
        where = _where(evidence, "settings", "docs/")
        lm = settings_cost(settings, "lm") if "lm" in settings["workloads"] else OWED
        return settings_cost(settings, "conv"), where, lm, where
    bench = _result(evidence, "bench")
    conv = OWED if bench is None else determinism_cost(bench)
    return conv, _where(evidence, "bench", "docs/"), OWED, ""


def render(name: str, evidence: Evidence) -> str:
    """The rows of block ``name``."""
    if name == "tradeoff":
        det = _twin(_result(evidence, "twin_deterministic"))
        fast = _twin(_result(evidence, "noise_floor"))
        conv, conv_where, lm, lm_where = _costs(evidence)
        return "\n".join(
            [
                "| | `true` | `false` | measured by |",
                "| --- | --- | --- | --- |",
                f"| bitwise-identical reruns, GPU | {det} | {fast} |"
                f" {_where(evidence, 'twin_deterministic', 'docs/')} |",
                f"| step-time cost of determinism, GPU, conv workload (vs torch's defaults)"
                f" | {conv} | baseline | {conv_where} |",
                f"| the same, transformer recipe at 25.4M parameters | {lm} | baseline |"
                f" {lm_where} |",
            ]
        )
    if name == "models":
        return render_models()
    if name == "lab":
        ops, trace = _result(evidence, "ops"), _result(evidence, "trace_overhead")
        alerts = OWED
        if ops is not None:
            differs = not_repeatable(ops)
            alerts = f"{len(differs)} of {len(ops['ops'])}: {', '.join(differs) or 'none'}"
        overhead = OWED if trace is None else trace_ratios(trace)
        return "\n".join(
            [
                "| GPU measurement | result | source |",
                "| --- | --- | --- |",
                f"| ops not repeatable in default mode | {alerts} |"
                f" {_where(evidence, 'ops', '')} |",
                f"| trace callback step time vs off (default detail) | {overhead} |"
                f" {_where(evidence, 'trace_overhead', '')} |",
            ]
        )
    if name == "ddp":
        return (
            "| | result | source |\n| --- | --- | --- |\n"
            "| 1-GPU DDP (`strategy: ddp, devices: 1`), two runs bit-identical | "
            f"{_twin(_result(evidence, 'ddp_twin'))} | {_where(evidence, 'ddp_twin', '')} |"
        )
    raise KeyError(name)


def render_models(folders: tuple[str, ...] = FOLDERS + SHARED) -> str:
    """Every GPU model's deterministic twin side by side: do two models train the same bits?"""
    lines = [
        "| evidence | GPU | torch | twin, `deterministic: true` | weights sha256 | run ID |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    digests = {}
    for folder in folders:
        path = GPU_DOCS / folder / "twin_deterministic.json"
        if not path.is_file():
            continue
        entry = json.loads(path.read_text())
        result = entry.get("result") or {}
        runs = result.get("runs")
        weights = runs[0]["model_sha256"][:16] if runs else "not recorded"
        run_id = runs[0]["run_id"][:12] if runs and runs[0]["run_id"] else "not recorded"
        if runs:
            digests[folder] = runs[0]["model_sha256"]
        torch = next((d["installed"] for d in entry["lock_drift"] if d["package"] == "torch"), "")
        lines.append(
            f"| [{folder}/]({folder}/) | {entry['device_name']} | {torch} | {_twin(result or None)}"
            f" | {weights} | {run_id} |"
        )
    if len(set(digests.values())) > 1:
        verdict = "GPU models with digests trained different bits: " + ", ".join(digests)
    elif len(digests) > 1:
        verdict = "GPU models with digests trained the same bits: " + ", ".join(digests)
    else:
        verdict = (
            f"Digests recorded on one GPU model so far ({', '.join(digests) or 'none'}): "
            "whether two models train the same bits is not yet measured."
        )
    return "\n".join([*lines, "", verdict])


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- gpu-rows:{name} -->\n)(.*?)(<!-- /gpu-rows:{name} -->)", re.S)


def update(text: str, name: str, evidence: dict[str, Any] | None) -> str:
    """``text`` with block ``name`` regenerated; ValueError if the markers are missing."""
    pattern = _block(name)
    if not pattern.search(text):
        raise ValueError(f"no <!-- gpu-rows:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + render(name, evidence) + "\n" + m.group(3), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    parser.add_argument(
        "--evidence",
        type=Path,
        action="append",
        help="evidence folders, newest first (default: docs/gpu/FOLDER for each of FOLDERS)",
    )
    args = parser.parse_args(argv)
    folders = args.evidence or [GPU_DOCS / folder for folder in FOLDERS]
    evidence = [run for folder in folders if (run := load_evidence(folder)) is not None]
    stale = []
    for name, path in DOCS.items():
        text = path.read_text()
        new = update(text, name, evidence)
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"gpu rows out of date in {', '.join(stale)}; run python benchmarks/gpu/gpu_rows.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
