"""``reprotrain ops``: a live catalog of ops with non-deterministic default paths.

Probes every entry of :data:`reprotrain.ops.catalog.CATALOG` on one device
(``--device``, default ``cuda`` when available) with
:func:`reprotrain.ops.probes.probe_op`: default mode repeated (identical
bits or not, largest difference), deterministic mode (torch raises, with its
message and its ``warn_only`` warning; or it runs, identical or not) and the
time ratio deterministic / default. Prints a markdown table and the elapsed
time; ``--out-md`` and ``--out-json`` write them, headed by the device name
and the torch version. What it shows is measured here and now; a table from
another device or torch build says nothing about this one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.atomic import atomic_write_text
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.command import Command
from reprotrain.pipeline.errors import DataError

if TYPE_CHECKING:  # torch loads when it probes, not when the CLI reads its options
    from reprotrain.ops.probes import OpResult

PARAMS: tuple[str, ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="device to probe (default: cuda if available)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="calls per mode and op (>= 2)")
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="probe only these ops"
    )
    parser.add_argument("--out-md", type=Path, help="write the markdown table here")
    parser.add_argument("--out-json", type=Path, help="write the results as JSON here")


#: Restarts: deterministic cuBLAS needs its workspace variable from the first handle on.
COMMAND = Command(
    "catalog of ops with non-deterministic default paths, measured on this device",
    add_arguments,
    restarts=True,
)


def run(_: object, args: argparse.Namespace) -> int:
    from reprotrain.commands._device import device_facts, pick_device
    from reprotrain.ops.catalog import CATALOG
    from reprotrain.ops.probes import probe_catalog

    if args.repeats < 2:
        raise DataError(f"--repeats {args.repeats}: need at least 2 calls to compare")
    known = {case.name for case in CATALOG}
    unknown = [name for name in args.only if name not in known]
    if unknown:
        raise DataError(f"--only {unknown[0]!r}: not in the catalog; one of {sorted(known)}")
    cases = [case for case in CATALOG if not args.only or case.name in args.only]
    device = pick_device(args.device)
    start = time.perf_counter()
    results = probe_catalog(device, cases, repeats=args.repeats)
    elapsed = time.perf_counter() - start
    report = {
        **device_facts(device),
        "repeats": args.repeats,
        "elapsed_s": round(elapsed, 3),
        "ops": [r.to_dict() for r in results],
    }
    markdown = render_markdown(report, results)
    if args.out_md is not None:
        atomic_write_text(args.out_md, markdown)
    if args.out_json is not None:
        atomic_write_text(args.out_json, canonical_json(report))
    print(markdown, end="")
    print(f"reprotrain ops: {len(results)} ops probed on {device} in {elapsed:.1f} s")
    return 0


def _cell(text: str | None, limit: int = 170) -> str:
    if not text:
        return ""
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _default_cell(r: OpResult) -> str:
    if r.default == "differs":
        return f"**differs** (max abs diff {r.default_max_abs_diff:.3g})"
    return r.default


def _deterministic_cell(r: OpResult) -> str:
    if r.deterministic in ("raises", "warns"):
        return f"**{r.deterministic}**"
    return r.deterministic


def render_markdown(report: dict[str, Any], results: list[OpResult]) -> str:
    """The catalog as a markdown section: what was probed, then one row per op."""
    lines = [
        f"# Non-deterministic ops on {report['device']}: {report['device_name']}",
        "",
        f"torch {report['torch']}, CUDA {report['cuda']}, cuDNN {report['cudnn']}, "
        f"{report['threads']} threads; {report['repeats']} calls per mode and op; "
        f"probed in {report['elapsed_s']:.1f} s by `reprotrain ops --device {report['device']}`.",
        "",
        "default: `use_deterministic_algorithms(False)`, every call's bits equal to the first's "
        "or not. deterministic: `use_deterministic_algorithms(True)`: torch raises (its message), "
        "warns, or runs (identical or not). ratio: median time deterministic / default.",
        "",
        "| op | default mode | deterministic mode | torch says | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ratio = "" if r.time_ratio is None else f"{r.time_ratio:.2f}"
        lines.append(
            f"| {r.name} | {_default_cell(r)} | {_deterministic_cell(r)} | "
            f"{_cell(r.message)} | {ratio} |"
        )
    return "\n".join(lines) + "\n"
