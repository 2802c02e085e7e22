"""A training run's files, found in a folder or at a git revision, and two runs compared.

A run is what the train stage writes: the weights, the per-step trace, the
run record (``run.json``: run ID, inputs, output hashes) and the
environment record it trained under. ``find_run`` accepts

* a repository folder (it has a ``dvc.yaml``): the paths the train stage's
  command line names there;
* a flat folder, as ``reprotrain verify`` leaves them: ``model.safetensors``,
  ``trace.safetensors``, ``run.json``, ``environment.json``;
* a git revision of the current repository: the files as committed there,
  the DVC-tracked ones read from the DVC cache (or remote) through
  ``dvc.api``, so nothing in the working tree changes;
* any script's outputs: a folder with ``--model``/``--trace`` naming the
  files inside it, or a single safetensors file (a trace when its metadata
  says so, else weights).

``compare_runs`` says "identical" only when the weights and the traces are
the same bytes; otherwise it explains with the library's comparisons (first
diverging step and record, per-tensor weights, environment and run-input
differences). What it could not compare it says, with the reason: a
revision's weights missing from the DVC cache leave only the traces, and then
"identical" carries "weights not compared" and the JSON's ``weights_equal`` is
``null``.

Fresh runs to compare come from :mod:`reprotrain.commands._rerun`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.atomic import atomic_path
from reprotrain.commands._git import git_show, is_revision
from reprotrain.hashing import sha256_file
from reprotrain.pipeline.command import stage_arguments
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.envdiff import EnvDiff, InputDiff, compare_environments, compare_inputs
from reprotrain.provenance.environment import HOST_FILE, HOST_KEY

if TYPE_CHECKING:  # torch and Lightning load only when two runs differ (verify stays fast)
    from reprotrain.compare.report import ComparisonReport
    from reprotrain.trace.tracefile import Trace

#: File names in a flat run folder (what `reprotrain verify` writes per run).
FLAT = {
    "model": "model.safetensors",
    "trace": "trace.safetensors",
    "record": "run.json",
    "environment": "environment.json",
}
#: The training metrics file in a flat run folder (final train loss and more).
METRICS = "train_metrics.json"
#: The op recordings folder in a run folder (``REPROTRAIN_OPS_DIR`` of a recorded rerun).
OPS_FOLDER = "ops"


@dataclass(frozen=True)
class RunFiles:
    """Where one run's files are; ``None`` for a file the run does not have."""

    label: str
    model: Path | None
    trace: Path | None = None
    record: Path | None = None
    environment: Path | None = None
    #: Why a file the run has could not be read (a revision's, out of the DVC cache), by name.
    unread: dict[str, str] = field(default_factory=dict, hash=False)

    def files(self) -> dict[str, Path]:
        found = {"model": self.model, "trace": self.trace, "record": self.record}
        return {name: path for name, path in found.items() if path is not None}


def train_outputs(dvc_yaml: Path) -> dict[str, str]:
    """The train stage's file paths, relative to the repository, as ``dvc_yaml`` names them."""
    args = stage_arguments("train", dvc_yaml)
    paths = {
        "model": args.model,
        "trace": args.trace,
        "record": args.run_record,
        "environment": args.env,
    }
    return {name: str(path) for name, path in paths.items() if path is not None}


def _existing(path: Path) -> Path | None:
    return path if path.is_file() else None


def run_in_folder(folder: Path, label: str | None = None) -> RunFiles:
    """The run in a repository folder or a flat run folder."""
    repository = (folder / "dvc.yaml").is_file()
    layout = train_outputs(folder / "dvc.yaml") if repository else FLAT
    paths = {name: folder / rel for name, rel in layout.items()}
    if not paths["model"].is_file():
        raise DataError(
            f"{paths['model']}: no trained model in {folder}; pass a run folder "
            "(`reprotrain verify` keeps them), a repository after `dvc repro`, or a git revision"
        )
    return RunFiles(
        label or str(folder),
        paths["model"],
        *(_existing(paths[name]) if name in paths else None for name in FLAT if name != "model"),
    )


def run_at_revision(repo: Path, rev: str, scratch: Path) -> RunFiles:
    """Copy the run committed at ``rev`` into ``scratch`` (flat layout) and describe it.

    The weights are DVC-cached; the trace is tracked in git (``cache: false``), so a
    clone with no DVC cache still compares step by step, without the weights.
    """
    import dvc.api
    from dvc.exceptions import DvcException

    shown = git_show(repo, rev, "dvc.yaml")
    if shown is None:
        raise DataError(f"{rev}: no dvc.yaml at this revision of {repo}")
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "dvc.yaml").write_bytes(shown)
    layout = train_outputs(scratch / "dvc.yaml")
    (scratch / "dvc.yaml").unlink()
    found: dict[str, Path] = {}
    unread: dict[str, str] = {}
    for name, rel in layout.items():
        dest = scratch / FLAT[name]
        try:
            with (
                dvc.api.open(rel, repo=str(repo), rev=rev, mode="rb") as src,
                atomic_path(dest) as tmp,
            ):
                tmp.write_bytes(src.read())
        except (DvcException, FileNotFoundError) as err:
            unread[name] = _why_unread(repo, rev, rel, err)
            continue
        found[name] = dest
    if "model" not in found and "trace" not in found:  # a trace in git is enough to compare
        raise DataError(
            f"{unread['model']}; `dvc pull` that revision's outputs or rerun it with `dvc repro`"
        )
    others = (found.get(name) for name in FLAT if name != "model")
    return RunFiles(rev, found.get("model"), *others, unread=unread)


def _why_unread(repo: Path, rev: str, rel: str, err: Exception) -> str:
    """Why ``rel`` at ``rev`` could not be read, in words that are true.

    DVC answers an output missing from the cache (and any remote) with "does not exist
    ... neither as a DVC output nor as a Git-tracked file"; when ``dvc.lock`` at ``rev``
    records the output, only its bytes are missing, and that is what is said.
    """
    from dvc.exceptions import PathMissingError

    md5 = _locked_md5(git_show(repo, rev, "dvc.lock"), rel)
    if md5 is not None and isinstance(err, PathMissingError):
        return (
            f"{rel} at {rev}: dvc.lock there records it (md5 {md5}), but it is not in the "
            "DVC cache here (nor in a remote DVC could read)"
        )
    return f"{rel} at {rev}: cannot read it ({type(err).__name__}: {err})"


def _locked_md5(lock: bytes | None, rel: str) -> str | None:
    """The md5 a ``dvc.lock`` (its bytes) records for the output ``rel``; None if none."""
    import yaml

    try:
        data = yaml.safe_load(lock) if lock else None
    except yaml.YAMLError:
        return None  # the revision's own commands say so; here it only words a reason
    stages = data.get("stages") if isinstance(data, dict) else None
    for stage in stages.values() if isinstance(stages, dict) else ():
        outs = stage.get("outs") if isinstance(stage, dict) else None
        for out in outs if isinstance(outs, list) else ():
            if isinstance(out, dict) and out.get("path") == rel and out.get("md5"):
                return str(out["md5"])
    return None


def named_files(spec: str, model: str | None = None, trace: str | None = None) -> RunFiles:
    """A single safetensors file, or the files ``model``/``trace`` name inside a folder."""
    path = Path(spec)
    if path.is_file():
        from reprotrain.trace.tracefile import is_trace_file

        try:
            is_trace = is_trace_file(path)
        except (OSError, ValueError) as err:
            raise DataError(f"{path}: not a readable safetensors file ({err})") from None
        return RunFiles(spec, None, path) if is_trace else RunFiles(spec, path)
    named = {name: path / rel for name, rel in (("model", model), ("trace", trace)) if rel}
    if missing := [str(p) for p in named.values() if not p.is_file()]:
        raise DataError(f"{missing[0]}: not found; check --model / --trace (paths inside {spec})")
    return RunFiles(spec, named.get("model"), named.get("trace"))


def find_run(
    spec: str, repo: Path, scratch: Path, model: str | None = None, trace: str | None = None
) -> RunFiles:
    """A file, a folder (repository, flat run folder, or named files) or a git revision."""
    if Path(spec).is_file() or (Path(spec).is_dir() and (model or trace)):
        return named_files(spec, model, trace)
    if Path(spec).is_dir():
        return run_in_folder(Path(spec), spec)
    if is_revision(repo, spec):
        return run_at_revision(repo, spec, scratch)
    raise DataError(
        f"{spec}: neither a folder nor a git revision of {repo}; pass a run folder (with "
        "model.safetensors) or a commit, branch or tag (`--repo` names another repository)"
    )


def _json(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable JSON ({err})") from None
    return data if isinstance(data, dict) else {}


def _with_host(path: Path | None) -> dict[str, Any]:
    """An environment record with the host facts beside it (``host.json``), shown, not deciding."""
    record = _json(path)
    host = path.with_name(HOST_FILE) if path is not None else None
    if record and HOST_KEY not in record and host is not None and host.is_file():
        record[HOST_KEY] = _json(host)
    return record


def _trace(path: Path | None) -> Trace | None:
    from reprotrain.trace.tracefile import load_trace

    if path is None:
        return None
    try:
        return load_trace(path)
    except ValueError as err:
        raise DataError(str(err)) from None


@dataclass(frozen=True)
class RunComparison:
    """Two runs: identical bytes or not, and the library's report explaining the difference."""

    a: RunFiles
    b: RunFiles
    hashes: dict[str, tuple[str, str]]
    inputs: list[InputDiff]
    environment: list[EnvDiff]
    #: Traces and weights compared; only when the bytes differ or a plot was asked for.
    report: ComparisonReport | None = None
    run_ids: tuple[str | None, str | None] = (None, None)
    notes: list[str] = field(default_factory=list)
    #: What a run holds but could not be compared, and why; said on the "identical" line.
    not_compared: list[str] = field(default_factory=list)
    #: The first differing op, from op recordings of the first diverging step (ops.align).
    ops: dict[str, Any] | None = None
    ops_text: str | None = None

    @property
    def identical(self) -> bool:
        return bool(self.hashes) and all(a == b for a, b in self.hashes.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a.label,
            "b": self.b.label,
            "identical": self.identical,
            "run_ids": list(self.run_ids),
            "sha256": {name: list(pair) for name, pair in self.hashes.items()},
            "notes": [*self.notes, *self.not_compared],
            "trace": None,
            "weights": [],
            "environment": [{**asdict(d), "voids": d.voids} for d in self.environment],
            "inputs": [asdict(d) for d in self.inputs],
            "guarantee_applies": not any(d.voids for d in self.environment),
            "ops": self.ops,
            **(self.report.to_dict() if self.report else {}),
            "weights_equal": self.weights_equal,
        }

    @property
    def weights_equal(self) -> bool | None:
        """The final weights: the same values (bits), or ``None`` when they were not compared."""
        if "model" not in self.hashes:
            return None
        a, b = self.hashes["model"]
        if a == b:
            return True
        weights = self.report.weights if self.report is not None else []
        return bool(weights) and all(d.equal for d in weights)  # only the metadata may differ

    def to_text(self) -> str:
        lines = [f"a: {self.a.label}", f"b: {self.b.label}"]
        if self.run_ids[0] or self.run_ids[1]:
            same = "same run ID" if self.run_ids[0] == self.run_ids[1] else "different run IDs"
            ids = " vs ".join(str(r)[:12] for r in self.run_ids)
            lines.append(f"run IDs: {ids} ({same})")
        lines += [f"note: {note}" for note in self.notes]
        if self.identical:  # the verdict line itself says what it did not compare
            compared = ", ".join(f"{name} {a[:12]}" for name, (a, _) in self.hashes.items())
            lines.append("; ".join([f"IDENTICAL: the same bits ({compared})", *self.not_compared]))
            return "\n".join(lines)
        lines += [f"note: {note}" for note in self.not_compared]
        unequal = [name for name, (a, b) in self.hashes.items() if a != b]
        lines.append(f"DIFFERENT: {', '.join(unequal)} differ")
        if self.report is not None:
            lines.append(self.report.to_text())
        if self.ops_text:
            lines.append(self.ops_text)
        return "\n".join(lines)


def with_op_diff(result: RunComparison, a: Path, b: Path, matched: str = "") -> RunComparison:
    """``result`` with opdiff's answer for the recordings ``a`` and ``b`` (imports torch).

    ``matched`` is added to the text when the recordings are identical.
    """
    from reprotrain.ops.align import OpRecordError, compare_recordings

    try:
        found = compare_recordings(a, b)
    except OpRecordError as err:
        return dataclasses.replace(result, ops_text=f"op recordings: {err}")
    from reprotrain.trace.diff import with_op_diagnosis

    text = found.to_text() + (matched if found.identical else "")
    report = result.report
    if report is not None and report.trace is not None:  # one diagnosis, the op recording's
        trace = with_op_diagnosis(report.trace, found.to_dict())
        report = dataclasses.replace(report, trace=trace)
    return dataclasses.replace(result, report=report, ops=found.to_dict(), ops_text=text)


def compare_runs(a: RunFiles, b: RunFiles, plot: Path | None = None) -> RunComparison:
    """Compare two runs' bytes; load and explain traces and weights only when they differ."""
    hashes, notes, not_compared = {}, [], []
    unread = "; ".join(dict.fromkeys(r.unread["model"] for r in (a, b) if "model" in r.unread))
    if a.model and b.model:
        hashes["model"] = (sha256_file(a.model), sha256_file(b.model))
    elif a.model or b.model:
        why = f" ({unread})" if unread else ""
        notes.append(f"only one run has weights: no weights comparison{why}")
    elif unread:  # two trace files compare as asked; a revision's weights were asked about too
        not_compared.append(
            f"weights not compared: {unread}; `dvc fetch --all-commits` (or check the "
            "revision out and `dvc pull`) to compare them"
        )
    if a.trace and b.trace:
        hashes["trace"] = (sha256_file(a.trace), sha256_file(b.trace))
    elif a.trace or b.trace:
        notes.append("only one run has a trace: no per-step comparison")
    else:
        notes.append("neither run has a trace: no per-step comparison")
    if not hashes:
        raise DataError(
            f"{a.label} and {b.label} hold nothing to compare with each other (weights against "
            "a trace?): give two weights files, two traces, or two run folders"
        )
    record_a, record_b = _json(a.record), _json(b.record)
    env_a, env_b = _with_host(a.environment), _with_host(b.environment)
    inputs = compare_inputs(record_a.get("inputs", {}), record_b.get("inputs", {}))
    environment = compare_environments(env_a, env_b) if env_a and env_b else []
    differ = any(x != y for x, y in hashes.values())
    report = None
    if differ or plot is not None:
        report = _explain(a, b, inputs, environment, differ, plot)
        weights = report.weights
        model_bytes_differ = len(set(hashes.get("model", ()))) == 2
        if weights and all(d.equal for d in weights) and model_bytes_differ:
            notes.append("the weights are the same bits; the model files differ in metadata only")
    run_ids = (record_a.get("run_id"), record_b.get("run_id"))
    return RunComparison(a, b, hashes, inputs, environment, report, run_ids, notes, not_compared)


def _explain(
    a: RunFiles,
    b: RunFiles,
    inputs: list[InputDiff],
    environment: list[EnvDiff],
    differ: bool,
    plot: Path | None,
) -> ComparisonReport:
    """The library's comparison of traces and weights (imports torch), and the loss plot."""
    from reprotrain.compare.report import ComparisonReport
    from reprotrain.compare.weights import compare_weights
    from reprotrain.hashing import load_safetensors
    from reprotrain.trace.diff import compare_traces, plot_losses

    trace_a, trace_b = _trace(a.trace), _trace(b.trace)
    if plot is not None and trace_a and trace_b:
        plot_losses(trace_a, trace_b, plot, labels=("a", "b"))
    weights = []
    if differ and a.model and b.model:
        weights = compare_weights(load_safetensors(a.model)[0], load_safetensors(b.model)[0])
    return ComparisonReport(
        trace=compare_traces(trace_a, trace_b) if trace_a and trace_b and differ else None,
        weights=weights,
        environment=environment,
        inputs=inputs,
    )
