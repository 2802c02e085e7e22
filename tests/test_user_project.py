"""The wine example (examples/tabular/) end to end: a user's own modules keep every guarantee.

Issue 29: a LightningModule and LightningDataModule in the user's own package
(``wine/``, named in params.yaml by ``class_path``), trained by the pipeline
through the example's own ``dvc.yaml``. One ``dvc repro`` of a copy of the
example is committed once per pytest run (:func:`wine_repo`); each test works
in its own copy of it (:func:`project`) and has a negative control:

- the user's code is in the cache key and the run ID (a line of ``wine/``, a
  byte of the data), and only it: restored, and with a file outside train's
  deps changed, nothing moves;
- ``dvc repro`` retrains a changed line, and the revert gives the first bits back;
- ``reprotrain verify`` finds the example IDENTICAL, and a planted unseeded
  draw in the data module NOT REPRODUCIBLE;
- world sizes 1 and 2 give the same files under ``train.world_size_invariant``
  and differ without it;
- SIGTERM mid-epoch then the same command again gives the uninterrupted run's
  bits, and a checkpoint whose random state is not the one at the signal does not;
- the contract refuses, in one line, a data module with neither a loader nor a
  dataset for a split, a model without ``test_step`` and a class that does not
  exist before DVC deletes an output, and an iterable training dataset before
  the first step (the
  unmodified example, which passes both checks, is :func:`wine_repo`'s run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from reprotrain.hashing import sha256_file
from reprotrain.resume import sidecar
from tests.helpers import (
    PROJECT_TRAIN_OUTPUTS,
    ROOT,
    RUN_OUTPUTS,
    built_once,
    cli_env,
    commit_all,
    edit_once,
    injected,
    project_train_argv,
    ranks,
    run_checked,
    run_cli,
)

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "tabular"
#: The env stage records the installed packages against this lock (no lock file in the example).
LOCK = {"REPROTRAIN_LOCK": str(ROOT / "requirements-cpu.lock")}
#: What the train stage writes (DVC outputs and metrics), compared byte for byte.
TRAIN_OUTPUTS = PROJECT_TRAIN_OUTPUTS
#: Everything the earlier run left that a refused run must not touch.
EARLIER_OUTPUTS = (*TRAIN_OUTPUTS, "reports/run.json", "reports/metrics.json", "dvc.lock")
#: 106 training samples in batches of 16: 7 steps an epoch; step 10 is epoch 1's batch 3.
SIGTERM_STEP = 10
INTERRUPT_CHECKPOINT = f"epoch=1-step={SIGTERM_STEP + 1}.ckpt"


@pytest.fixture(scope="module")
def wine_repo(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The example in a fresh git repository after `dvc repro`, committed. Do not modify.

    Built once per pytest run (``built_once``), as conftest's ``dvc_repo``.
    """

    def build(built: Path) -> None:
        listed = run_checked(
            "git", "ls-files", "-z", "-co", "--exclude-standard", EXAMPLE, cwd=ROOT
        )
        for name in filter(None, listed.split("\0")):
            target = built / Path(name).relative_to(EXAMPLE.relative_to(ROOT))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target)
        run_checked("git", "init", "-q", cwd=built)
        run_checked("dvc", "init", "-q", cwd=built)
        out = run_checked("dvc", "repro", cwd=built, **LOCK)
        assert "checked wine.model.WineMLP and wine.data.WineData" in out, out
        commit_all(built, "the wine example and its reference run")

    return built_once(tmp_path_factory.getbasetemp(), worker_id, "wine_repo", build)


@pytest.fixture
def project(wine_repo: Path, tmp_path: Path) -> Path:
    """A private copy of :func:`wine_repo` (git history and DVC cache included) to change."""
    return Path(shutil.copytree(wine_repo, tmp_path / "wine", symlinks=True))


def _cli(repo: Path, *args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=repo, **LOCK, **env)


def _dvc(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`dvc ARGS` in ``repo``; never raises on failure."""
    return subprocess.run(
        ["dvc", *args], cwd=repo, env=cli_env(**LOCK), capture_output=True, text=True, timeout=600
    )


def _run_id(repo: Path) -> str:
    result = _cli(repo, "run-id")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _recorded_run_id(repo: Path) -> str:
    return json.loads((repo / "reports" / "run.json").read_text())["run_id"]


def _digests(repo: Path, names: tuple[str, ...]) -> dict[str, str]:
    return {name: sha256_file(repo / name) for name in names}


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one ``reprotrain: error:`` line of a failed command (and no traceback)."""
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("reprotrain: error:")]
    assert len(errors) == 1 and "Traceback" not in output, output
    return errors[0]


# -- the cache key and the run ID --------------------------------------------------------


def test_a_changed_line_of_user_code_flips_status_and_the_run_id_and_restoring_it_restores_both(
    project: Path,
) -> None:
    def up_to_date() -> None:
        assert "Data and pipelines are up to date" in run_checked(
            "dvc", "status", "train", cwd=project, **LOCK
        )
        status = _cli(project, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "reprotrain status: up to date" in status.stdout

    def stale(path: str) -> None:
        dvc = run_checked("dvc", "status", "train", cwd=project, **LOCK)
        assert "changed deps" in dvc and f"modified:           {path}" in dvc, dvc
        status = _cli(project, "status")
        assert status.returncode == 1, status.stdout + status.stderr
        assert f"train: changed deps: {path} (modified)" in status.stdout

    up_to_date()
    before = _run_id(project)
    assert before == _recorded_run_id(project)

    edit_once(project / "wine" / "model.py", "nn.ReLU(),", "nn.Tanh(),")
    stale("wine")
    assert _run_id(project) != before

    # Negative control: restored, with a file outside train's deps edited and bytecode in
    # the package folder (not code: .dvcignore and the run ID's *.py leave it out), nothing
    # moves.
    run_checked("git", "checkout", "--", "wine/model.py", cwd=project)
    with (project / "README.md").open("a") as readme:
        readme.write("\nA note that decides no bits.\n")
    bytecode = project / "wine" / "__pycache__" / "model.cpython-311.pyc"
    bytecode.parent.mkdir(exist_ok=True)
    bytecode.write_bytes(b"another interpreter's bytecode")
    up_to_date()
    assert _run_id(project) == before

    # One byte of the data: the first feature value of the first sample, 14.23 -> 24.23.
    csv = project / "data" / "wine.csv"
    blob = bytearray(csv.read_bytes())
    first = blob.index(b"\n") + 1
    assert blob[first : first + 5] == b"14.23"
    blob[first] = ord("2")
    csv.write_bytes(bytes(blob))
    stale("data/wine.csv")
    assert _run_id(project) != before


def test_dvc_repro_retrains_a_changed_line_and_the_revert_gives_back_the_first_bits(
    project: Path, wine_repo: Path
) -> None:
    first = _digests(wine_repo, (*TRAIN_OUTPUTS, "reports/metrics.json"))
    first_id = _recorded_run_id(wine_repo)
    edit_once(project / "wine" / "model.py", "nn.ReLU(),", "nn.Tanh(),")
    out = run_checked("dvc", "repro", cwd=project, **LOCK)
    assert "Running stage 'train'" in out, out
    assert _recorded_run_id(project) != first_id
    changed = _digests(project, TRAIN_OUTPUTS)
    assert changed["models/model.safetensors"] != first["models/model.safetensors"]

    # Negative control: the revert is not another retrain that lands elsewhere. DVC's run
    # cache or a retrain (run.json is not cached), either way the first run's bytes.
    run_checked("git", "checkout", "--", "wine/model.py", cwd=project)
    run_checked("dvc", "repro", cwd=project, **LOCK)
    assert _digests(project, (*TRAIN_OUTPUTS, "reports/metrics.json")) == first
    reverted, reference = (
        json.loads((repo / "reports" / "run.json").read_text()) for repo in (project, wine_repo)
    )
    assert (reverted["run_id"], reverted["outputs"]) == (first_id, reference["outputs"])


# -- verify ------------------------------------------------------------------------------


def test_verify_finds_the_example_identical_and_a_planted_unseeded_draw_not(
    project: Path, wine_repo: Path, tmp_path: Path
) -> None:
    work = tmp_path / "verify"
    result = _cli(project, "verify", "--workdir", work)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reprotrain verify: IDENTICAL (2 runs)" in result.stdout
    # Both fresh runs are the committed reference run's bits.
    for run in ("run-1", "run-2"):
        model = work / run / "model.safetensors"
        assert sha256_file(model) == sha256_file(wine_repo / "models" / "model.safetensors")

    # Negative control: the data module's feature noise from a generator seeded by
    # os.urandom, the kind of draw no seed reaches.
    data = project / "wine" / "data.py"
    edit_once(data, "import csv\n", "import csv\nimport os\n")
    edit_once(
        data,
        "torch.randn(x.shape, dtype=x.dtype)",
        "torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed("
        "int.from_bytes(os.urandom(8), 'little') >> 1))",
    )
    result = _cli(project, "verify", "-S", "train.max_epochs=1", "--workdir", tmp_path / "planted")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "reprotrain verify: NOT REPRODUCIBLE (2 runs; differ: run-1 vs run-2)" in result.stdout
    assert "batch differs first" in result.stdout, result.stdout


# -- world sizes -------------------------------------------------------------------------


def test_world_sizes_1_2_and_4_give_the_same_files_only_under_the_invariant_mode(
    project: Path, tmp_path: Path
) -> None:
    # 14 steps (an epoch boundary and its reshuffle); batches of 16 in micro-batches of 4:
    # at world size 2 each rank accumulates two, at 4 each takes one.
    short = ("-S", "train.max_epochs=2", "-S", "train.micro_batch_size=4")

    def train(name: str, world: int, *overrides: str) -> Path:
        out = tmp_path / name
        result = _cli(project, *project_train_argv(project, out, *short, *overrides, *ranks(world)))
        assert result.returncode == 0, result.stderr[-3000:]
        for rank in range(1, world):  # every process trained, not rank 0 alone
            assert f"reprotrain train: rank {rank} trained run" in result.stdout, result.stdout
        return out

    invariant = ("-S", "train.world_size_invariant=true")
    runs = {n: train(f"invariant-{n}", n, *invariant) for n in (1, 2, 4)}
    for name in RUN_OUTPUTS:
        digests = {n: sha256_file(runs[n] / name) for n in runs}
        assert len(set(digests.values())) == 1, (name, digests)

    # Negative control: plain DDP, the world size decides the bits (and the run ID).
    plain = {n: train(f"plain-{n}", n) for n in (1, 2, 4)}
    models = {n: sha256_file(plain[n] / "model.safetensors") for n in plain}
    assert len(set(models.values())) == 3, models
    ids = {n: json.loads((plain[n] / "run.json").read_text())["run_id"] for n in plain}
    assert len(set(ids.values())) == 3, ids


# -- SIGTERM mid-epoch -------------------------------------------------------------------


def _sigterm_at_step(repo: Path, argv: list[str]) -> None:
    """Run the train stage with SIGTERM at the start of step SIGTERM_STEP (tests/inject)."""
    result = _cli(repo, *argv, **injected(REPROTRAIN_TEST_SIGTERM_AT_STEP=str(SIGTERM_STEP)))
    assert result.returncode == 130, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("reprotrain: error: training interrupted (SIGTERM)"), last
    assert f"its last checkpoint, {INTERRUPT_CHECKPOINT}, is kept" in last, last
    assert not (repo / "models" / "model.safetensors").exists()


def _without_outputs(repo: Path) -> None:
    """Remove train's outputs, as `dvc repro` does before it runs the stage."""
    for name in (*TRAIN_OUTPUTS, "reports/run.json"):
        (repo / name).unlink(missing_ok=True)


def _with_other_random_state(checkpoint: Path) -> None:
    """Replace the torch generator state saved at the signal with a fresh seed's, re-signed."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    ranks = saved["callbacks"]["RandomStateCallback"]["ranks"]
    assert len(ranks) == 1
    ranks[0]["torch"] = torch.Generator().manual_seed(12345).get_state()
    torch.save(saved, checkpoint)
    sidecar(checkpoint).write_text(f"{sha256_file(checkpoint)}  {checkpoint.name}\n")


@pytest.mark.parametrize(
    "workers",
    [
        pytest.param(
            0,
            id="num_workers 0 (the example's params)",
        ),
        pytest.param(2, id="num_workers 2"),
    ],
)
def test_sigterm_mid_epoch_then_the_same_command_gives_the_uninterrupted_bits(
    workers: int, project: Path, wine_repo: Path, tmp_path: Path
) -> None:
    # The train stage's own command (dvc.yaml), in the project; with no override its run
    # ID is the reference run's, so wine_repo's outputs are the uninterrupted bits.
    if workers == 0:
        argv = project_train_argv(project, None)  # the reference run's command: 20 epochs
        straight = _digests(wine_repo, TRAIN_OUTPUTS)
    else:  # another run ID: an uninterrupted run of its own first (3 epochs)
        overrides = ("-S", f"data.init_args.num_workers={workers}", "-S", "train.max_epochs=3")
        argv = project_train_argv(project, None, *overrides)
        result = _cli(project, *argv)
        assert result.returncode == 0, result.stderr
        straight = _digests(project, TRAIN_OUTPUTS)
    straight_record = json.loads((project / "reports" / "run.json").read_text())

    _without_outputs(project)
    _sigterm_at_step(project, argv)
    checkpoints = project / "checkpoints"
    kept = Path(shutil.copytree(checkpoints, tmp_path / "kept"))
    result = _cli(project, *argv)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {INTERRUPT_CHECKPOINT}" in result.stdout, result.stdout
    assert _digests(project, TRAIN_OUTPUTS) == straight
    resumed = json.loads((project / "reports" / "run.json").read_text())
    assert (resumed["run_id"], resumed["outputs"]) == (
        straight_record["run_id"],
        straight_record["outputs"],
    )

    # Negative control: the same checkpoint with another torch generator state (what a
    # resume without the random state gives) resumes to other bits.
    _without_outputs(project)
    shutil.rmtree(checkpoints)
    shutil.copytree(kept, checkpoints)
    (interrupt,) = checkpoints.glob(f"*/{INTERRUPT_CHECKPOINT}")
    _with_other_random_state(interrupt)
    result = _cli(project, *argv)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {INTERRUPT_CHECKPOINT}" in result.stdout, result.stdout
    other = _digests(project, TRAIN_OUTPUTS)
    assert other["models/model.safetensors"] != straight["models/model.safetensors"]


# -- the contract's refusals -------------------------------------------------------------

#: name -> (file, old, new, what the one error line says: the key and class, and why)
REFUSED_BEFORE_DELETION = {
    "a data module with neither a loader nor a dataset for a split": (
        "wine/data.py",
        "    def test_dataset(self)",
        "    def testing_dataset(self)",
        (
            "data.class_path: wine.data.WineData defines neither test_dataloader() nor "
            "test_dataset()",
            "the evaluate stage scores it",
        ),
    ),
    "a model without test_step": (
        "wine/model.py",
        "    def test_step(self, batch: Batch, batch_idx: int) -> None:\n"
        '        self._log_scores(batch, "test")\n\n',
        "",
        (
            "model.class_path: wine.model.WineMLP defines no test_step",
            "the evaluate stage scores the test split",
        ),
    ),
    "a class that does not exist": (
        "params.yaml",
        "class_path: wine.model.WineMLP",
        "class_path: wine.model.WineMPL",
        ("model.class_path: module 'wine.model' has no 'WineMPL'", "fix the spelling"),
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED_BEFORE_DELETION))
def test_the_env_stage_refuses_a_broken_contract_in_one_line_before_dvc_deletes_an_output(
    case: str, project: Path, wine_repo: Path
) -> None:
    file, old, new, says = REFUSED_BEFORE_DELETION[case]
    edit_once(project / file, old, new)
    result = _dvc(project, "repro")
    assert result.returncode != 0, result.stdout + result.stderr
    line = _error_line(result)
    assert all(part in line for part in says), line
    assert "Running stage 'train'" not in result.stdout + result.stderr
    assert _digests(project, EARLIER_OUTPUTS) == _digests(wine_repo, EARLIER_OUTPUTS)


def test_an_iterable_training_dataset_is_refused_in_one_line_and_the_earlier_outputs_stay(
    project: Path, wine_repo: Path
) -> None:
    data = project / "wine" / "data.py"
    edit_once(
        data,
        'return NoisyFeatures(*self._split("train"), noise=self.noise)',
        'return Stream(NoisyFeatures(*self._split("train"), noise=self.noise))',
    )
    with data.open("a") as module:
        module.write(
            "\n\nclass Stream(torch.utils.data.IterableDataset):\n"
            "    def __init__(self, dataset: Dataset) -> None:\n"
            "        self.dataset = dataset\n\n"
            "    def __iter__(self):\n"
            "        return (self.dataset[i] for i in range(len(self.dataset)))\n"
        )
    result = _dvc(project, "repro")
    assert result.returncode != 0, result.stdout + result.stderr
    line = _error_line(result)
    assert "train_dataset() returned a Stream, not a map-style dataset" in line, line
    assert "mid-epoch resume" in line, line
    # The classes pass the env stage's checks (a dataset exists only after setup()), so the
    # train stage refuses it, after DVC has removed train's outputs to run it: the env
    # stage kept them aside, and the train stage puts them back (reprotrain.pipeline.kept).
    assert "Running stage 'train'" in result.stdout + result.stderr
    assert "the earlier outputs are back in place: models/model.safetensors" in line, line
    assert _digests(project, EARLIER_OUTPUTS) == _digests(wine_repo, EARLIER_OUTPUTS)
    assert not list((project / "checkpoints").rglob("*.ckpt"))
    # Control: by hand (no dvc repro), nothing is kept or put back.
    _without_outputs(project)
    result = _cli(project, *project_train_argv(project, None))
    assert "the earlier outputs are back" not in _error_line(result)
    assert not (project / "models" / "model.safetensors").exists()


# -- compare and opdiff ------------------------------------------------------------------


def test_compare_finds_two_runs_identical_and_blames_another_seed_from_step_zero(
    project: Path, tmp_path: Path
) -> None:
    short = ("-S", "train.max_epochs=1")

    def train(name: str, *overrides: str) -> Path:
        out = tmp_path / name
        result = _cli(project, *project_train_argv(project, out, *short, *overrides))
        assert result.returncode == 0, result.stderr[-3000:]
        return out

    a, b = train("a"), train("b")
    same = _cli(project, "compare", a, b)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "IDENTICAL: the same bits" in same.stdout, same.stdout

    # Negative control: another seed differs from the first step, and compare says why.
    other = train("other-seed", "-S", "seed=43")
    text = _cli(project, "compare", a, other)
    assert text.returncode == 1, text.stdout + text.stderr
    assert "traces diverge at step 0 (row 0)" in text.stdout, text.stdout
    assert "params.seed: 42 -> 43" in text.stdout, text.stdout
    report = json.loads(_cli(project, "compare", a, other, "--json").stdout)
    assert report["trace"]["first_step"] == 0
    assert "params.seed" in {d["key"] for d in report["inputs"]}


#: Unseeded NumPy noise on the features in the user's training_step (the planted fault).
#: Unseeded noise in the recorded step alone (2), so steps 0 and 1 leave the weights equal.
NUMPY_NOISE = (
    "        x, y = batch\n        return F.cross_entropy(self(x), y)",
    "        x, y = batch\n"
    "        if self.global_step == 2:\n"
    "            x = x + torch.from_numpy(np.random.default_rng().normal(size=x.shape)).to(x)\n"
    "        return F.cross_entropy(self(x), y)",
)
#: Mid-epoch (7 steps an epoch): no metric is reset in it, whose deep copy reads memory
#: torch allocated and never wrote (torchmetrics' Metric.reset), which an op recording of
#: an epoch's first step shows as a difference between equal runs.
RECORDED_STEP = "2"


def test_opdiff_finds_two_recordings_of_a_step_identical_and_names_planted_noise_at_its_line(
    project: Path, tmp_path: Path
) -> None:
    short = ("-S", "train.max_epochs=1")

    def recorded(name: str) -> Path:
        out = tmp_path / name
        ops = out / "ops"
        argv = project_train_argv(project, out, *short)
        result = _cli(
            project, *argv, REPROTRAIN_RECORD_OPS=RECORDED_STEP, REPROTRAIN_OPS_DIR=str(ops)
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert (ops / "ops-rank0.safetensors").is_file(), sorted(out.rglob("*"))
        return ops

    a, b = recorded("a"), recorded("b")
    same = _cli(project, "opdiff", a, b)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "op recordings identical" in same.stdout, same.stdout

    # Negative control: unseeded NumPy noise in the user's training_step, recorded twice.
    model = project / "wine" / "model.py"
    edit_once(model, "import torch\n", "import numpy as np\nimport torch\n")
    edit_once(model, *NUMPY_NOISE)
    c, d = recorded("noisy-c"), recorded("noisy-d")
    text = _cli(project, "opdiff", c, d)
    assert text.returncode == 1, text.stdout + text.stderr
    report = json.loads(_cli(project, "opdiff", "--json", c, d).stdout)
    line = next(i for i, s in enumerate(model.read_text().splitlines(), 1) if "default_rng" in s)
    assert report["kind"] == "inputs", report
    assert "made outside torch ops" in " ".join(report["differing_inputs"]), report
    assert report["op"]["line"].endswith(f"wine/model.py:{line}"), report
    assert f"wine/model.py:{line}" in text.stdout, text.stdout


# -- make check-reference ----------------------------------------------------------------


def test_check_reference_reproduces_the_committed_example_and_not_a_tampered_metric(
    project: Path,
) -> None:
    result = _cli(project, "verify", "--reference", "HEAD")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reprotrain verify: REPRODUCED: HEAD's reference" in result.stdout, result.stdout

    # Negative control: a committed metrics.json that no run of this code wrote.
    metrics = project / "reports" / "metrics.json"
    text = metrics.read_text()
    assert "0." in text, text
    metrics.write_text(text.replace("0.", "1.", 1))
    commit_all(project, "a tampered metric")
    result = _cli(project, "verify", "--reference", "HEAD")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "reprotrain verify: NOT REPRODUCED: HEAD's outputs differ here" in result.stdout
    assert "  reports/metrics.json" in result.stdout, result.stdout
