"""The docs' GPU rows, generated from the raw outputs of ``make gpu-evidence`` in docs/gpu/.

Each generated block sits between ``<!-- gpu-rows:NAME -->`` and
``<!-- /gpu-rows:NAME -->`` in README.md, docs/lab.md or docs/scaling-out.md.
While docs/gpu/summary.json is absent every row says "not yet measured";
outputs of a CPU dry run never count as GPU evidence. tests/test_gpu_evidence.py
runs ``--check``, so the docs cannot drift from the committed outputs.

    python benchmarks/gpu_rows.py            # rewrite the blocks
    python benchmarks/gpu_rows.py --check    # exit 1 if a block is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from gpu_evidence import determinism_cost, not_repeatable, trace_ratios, twin_difference

ROOT = Path(__file__).resolve().parents[1]
DOCS = {
    "tradeoff": ROOT / "README.md",
    "lab": ROOT / "docs" / "lab.md",
    "ddp": ROOT / "docs" / "scaling-out.md",
}
OWED = "not yet measured"
SOURCE = "`make gpu-evidence` ([docs/gpu/summary.md]({up}gpu/summary.md))"


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
    return {"summary": summary, "steps": steps}


def _result(evidence: dict[str, Any] | None, step: str) -> dict[str, Any] | None:
    if evidence is None:
        return None
    entry = evidence["steps"].get(step)
    return entry["result"] if entry and entry["status"] == "ok" else None


def _twin(result: dict[str, Any] | None) -> str:
    if result is None:
        return OWED
    return "yes, 2 of 2" if result["identical"] else f"no: {twin_difference(result)}"


def _where(evidence: dict[str, Any] | None, up: str) -> str:
    if evidence is None:
        return ""
    return f"{evidence['summary']['device_name']}: " + SOURCE.format(up=up)


def render(name: str, evidence: dict[str, Any] | None) -> str:
    """The rows of block ``name``."""
    if name == "tradeoff":
        where = _where(evidence, "docs/")
        det = _twin(_result(evidence, "twin_deterministic"))
        fast = _twin(_result(evidence, "noise_floor"))
        bench = _result(evidence, "bench")
        cost = OWED if bench is None else determinism_cost(bench)
        return "\n".join(
            [
                "| | `true` | `false` | measured by |",
                "| --- | --- | --- | --- |",
                f"| bitwise-identical reruns, GPU | {det} | {fast} | {where} |",
                f"| step-time cost of determinism, GPU (conv workload) | {cost} | baseline |"
                f" {where} |",
            ]
        )
    if name == "lab":
        where = _where(evidence, "")
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
                f"| ops not repeatable in default mode | {alerts} | {where} |",
                f"| trace callback step time vs off (default detail) | {overhead} | {where} |",
            ]
        )
    if name == "ddp":
        return (
            "| | result | source |\n| --- | --- | --- |\n"
            "| 1-GPU DDP (`strategy: ddp, devices: 1`), two runs bit-identical | "
            f"{_twin(_result(evidence, 'ddp_twin'))} | {_where(evidence, '')} |"
        )
    raise KeyError(name)


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
    parser.add_argument("--evidence", type=Path, default=ROOT / "docs" / "gpu")
    args = parser.parse_args(argv)
    evidence = load_evidence(args.evidence)
    stale = []
    for name, path in DOCS.items():
        text = path.read_text()
        new = update(text, name, evidence)
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"gpu rows out of date in {', '.join(stale)}; run python benchmarks/gpu_rows.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
