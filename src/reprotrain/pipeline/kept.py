"""The train and evaluate stages' earlier outputs, kept aside by the env stage and put back
if the stage fails.

DVC deletes a stage's outputs before it runs the stage's command. Most bad
input is refused by the ``env`` stage before that (:mod:`reprotrain.pipeline.contract`),
but some only the train or evaluate stage can see (a dataset that exists after the
prepare stage ran, a link ``setup`` did not set, weights that do not fit the
module); without this, such a refusal would leave the workspace without the
last good run's weights, trace, metrics, curves and run record, or its test
metrics, while ``dvc.lock`` still names them. ``dvc checkout`` would not bring
back those ``dvc.yaml`` marks ``cache: false`` (``reports/metrics.json``).

So, under ``dvc repro`` only (DVC sets ``DVC_STAGE`` and ``DVC_ROOT`` for a
stage's command), the env stage, once its checks pass, hard-links the train
and evaluate stages' current outputs (as their command lines in ``dvc.yaml``
name them) into ``.dvc/tmp/reprotrain-kept/`` (a copy where no hard link can
be made; DVC writes a new file rather than into an old one, so the link keeps
the old bytes). A stage that fails in any way moves each of its kept outputs
back, in place of whatever the failed run wrote of it (a model written before
the metrics failed), removes what it wrote of an output nothing was kept of
where DVC deleted that output before the stage ran (an ``outs`` entry without
``persist``: nothing partial stays, nothing else is touched), and notes so on
its error (:func:`note_put_back`);
one that succeeds drops what was kept for it. A failed evaluate after a train that
succeeded puts back the metrics of the earlier weights, as ``dvc.lock``'s
evaluate entry still records them. ``reprotrain train`` or ``evaluate`` run by
hand keeps and restores nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

#: Under ``DVC_ROOT``: one folder per pipeline, by its folder relative to the root.
KEPT = Path(".dvc") / "tmp" / "reprotrain-kept"


#: The start of the note a stage's error gets when it put the earlier outputs back; the
#: CLI's one error line ends with it instead of pointing at ``dvc checkout``.
PUT_BACK = "the earlier outputs are back in place: "


def train_outputs(args: argparse.Namespace) -> list[Path]:
    """The files and folders the train stage writes (its output options, as parsed)."""
    named = (args.model, args.trace, args.metrics, args.plots, args.run_record)
    return [path for path in named if path is not None]


def evaluate_outputs(args: argparse.Namespace) -> list[Path]:
    """The file the evaluate stage writes (its ``--metrics``, as parsed)."""
    return [args.metrics]


def pipeline_file() -> Path | None:
    """The ``dvc.yaml`` of the stage ``dvc repro`` runs now; None outside ``dvc repro``."""
    root, stage = os.environ.get("DVC_ROOT"), os.environ.get("DVC_STAGE")
    if not root or not stage:
        return None
    file = Path(root) / (stage.rpartition(":")[0] or "dvc.yaml")  # "pipelines/lm/dvc.yaml:env"
    return file if file.is_file() or stage.rpartition(":")[0] == "" else None


def kept_folder() -> Path | None:
    """Where the running stage's pipeline keeps outputs (one folder per ``dvc.yaml``); None
    outside ``dvc repro``. Paths in it are relative to the stage's working directory, which
    env, train and evaluate share (their ``wdir``)."""
    file = pipeline_file()
    if file is None:
        return None
    root = Path(os.environ["DVC_ROOT"])
    return root / KEPT / file.parent.relative_to(root)


def keep(outputs: Iterable[Path]) -> list[Path]:
    """Link each existing output (a file or a folder's files) into :func:`kept_folder`,
    after dropping what was kept before; return the outputs kept."""
    folder = kept_folder()
    if folder is None:
        return []
    shutil.rmtree(folder, ignore_errors=True)
    kept = []
    try:
        for output in _inside(outputs):
            if output.is_file():
                _link(output, folder / output)
            elif output.is_dir():
                for file in (p for p in output.rglob("*") if p.is_file()):
                    _link(file, folder / file)
            else:
                continue
            kept.append(output)
    except OSError:  # all or nothing: never put back a part of the last run
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return kept


def put_back(outputs: Iterable[Path]) -> list[Path]:
    """Move each kept output back from :func:`kept_folder` in place of what the failed run
    wrote of it, and remove what it wrote of the others; return those restored."""
    folder = kept_folder()
    restored = []
    deleted_by_dvc = _deleted_by_dvc()
    for output in _inside(outputs) if folder is not None else []:
        source = folder / output  # type: ignore[operator]
        if source.exists():
            _remove(output)  # what the failed run wrote of it
            output.parent.mkdir(parents=True, exist_ok=True)
            source.replace(output)
            restored.append(output)
        elif output.resolve() in deleted_by_dvc:  # so all there is of it is the failed run's
            _remove(output)
    return restored


def _deleted_by_dvc() -> set[Path]:
    """The running stage's outputs DVC deletes before it runs the stage (its ``outs`` less
    ``persist: true`` ones), resolved; none outside ``dvc repro``."""
    from reprotrain.pipeline.command import pipeline_stages

    file, stage = pipeline_file(), os.environ.get("DVC_STAGE", "").rpartition(":")[2]
    found = pipeline_stages(file).get(stage) if file is not None else None
    if found is None:
        return set()
    wdir = file.parent / str(found.get("wdir", "."))  # type: ignore[union-attr]
    deleted = set()
    for out in found.get("outs") or []:
        path, options = (out, {}) if isinstance(out, str) else next(iter(out.items()))
        if not (isinstance(options, dict) and options.get("persist") is True):
            deleted.add((wdir / str(path)).resolve())
    return deleted


def _remove(output: Path) -> None:
    if output.is_dir() and not output.is_symlink():
        shutil.rmtree(output)
    else:
        output.unlink(missing_ok=True)


def note_put_back(err: BaseException, restored: list[Path]) -> None:
    """Say on ``err`` that ``restored`` are back (:data:`PUT_BACK`), as a note (PEP 678): a
    traceback shows it on the line after the exception's, the CLI at the end of its one
    error line; never inside the exception's own message (a ``KeyError`` quotes that)."""
    err.add_note(PUT_BACK + ", ".join(str(path) for path in restored))


def drop(outputs: Iterable[Path]) -> None:
    """Forget what was kept of ``outputs`` (the stage wrote new ones)."""
    folder = kept_folder()
    for output in _inside(outputs) if folder is not None else []:
        kept = folder / output  # type: ignore[operator]
        if kept.is_dir():
            shutil.rmtree(kept, ignore_errors=True)
        else:
            kept.unlink(missing_ok=True)


def _inside(outputs: Iterable[Path]) -> list[Path]:
    """The outputs given relative to the working directory (dvc.yaml's paths)."""
    return [p for p in outputs if not p.is_absolute() and ".." not in p.parts]


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
