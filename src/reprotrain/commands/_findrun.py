"""A training run's files, found in a folder, at a git revision, or named one by one.

A run is what the train stage writes: the weights, the per-step trace, the
run record (``run.json``: run ID, inputs, output hashes) and the
environment record it trained under. ``find_run`` accepts

* a repository folder (it has a ``dvc.yaml``): the paths the train stage's
  command line names there;
* a flat folder, as ``reprotrain verify`` leaves them: ``model.safetensors``,
  ``trace.safetensors``, ``run.json``, ``environment.json``;
* a git revision of the current repository: the files as committed there,
  the DVC-tracked ones read from the DVC cache (or remote) through
  ``dvc.api``, so nothing in the working tree changes; a file it cannot read
  is kept in ``RunFiles.unread`` with the reason, for the comparison to say;
* any script's outputs: a folder with ``--model``/``--trace`` naming the
  files inside it, or a single safetensors file (a trace when its metadata
  says so, else weights).

Two runs found here are compared by :mod:`reprotrain.commands._rundiff`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from reprotrain.atomic import atomic_path
from reprotrain.commands._git import git_show, is_revision
from reprotrain.pipeline.command import stage_arguments
from reprotrain.pipeline.errors import DataError

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
            f"{paths['model']}: no trained model in {folder}; a folder of any script's outputs "
            "needs --model (and --trace) naming its files inside it, e.g. --model "
            "model.safetensors; else pass a repository after `dvc repro`, a folder the "
            "pipeline's `reprotrain verify` kept, or a git revision"
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
