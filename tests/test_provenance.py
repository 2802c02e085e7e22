"""Run IDs, DVC checksums and the checklist, unit-level and through a real `dvc repro`."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from reprotrain.determinism import configure_determinism
from reprotrain.pipeline.params_file import load_params
from reprotrain.pipeline.recipe import resolve_recipe
from reprotrain.pipeline.stages import train
from reprotrain.provenance.dvcchecksum import ChecksumError, md5_file, verify_dvc_checksum
from reprotrain.provenance.environment import capture_environment
from reprotrain.provenance.identity import code_hash, run_id, source_files
from tests.helpers import ROOT, commit_all, run_checked, run_cli, run_in_process, stage_argv

pytestmark = pytest.mark.usefixtures("restore_torch_flags")


@pytest.fixture
def inputs_for(prepared: Path):
    environment = capture_environment(ROOT / "requirements-cpu.lock")

    def make(overrides=(), data=prepared, env=environment):
        params = load_params(ROOT / "params.yaml", overrides)
        settings = configure_determinism(params.seed, params.deterministic)
        return train.stage_inputs(params, resolve_recipe(params), [data], env, None, settings)

    return make


def test_same_inputs_give_the_same_run_id(inputs_for) -> None:
    assert run_id(inputs_for()) == run_id(inputs_for())


def test_one_param_changes_the_run_id(inputs_for) -> None:
    assert run_id(inputs_for(["model.init_args.lr=0.004"])) != run_id(inputs_for())


def test_a_param_train_does_not_read_keeps_the_run_id(inputs_for) -> None:
    assert run_id(inputs_for(["prepare.test_fraction=0.2"])) == run_id(inputs_for())


def test_one_data_byte_changes_the_run_id(inputs_for, prepared: Path, tmp_path: Path) -> None:
    flipped = tmp_path / "data.safetensors"
    blob = bytearray(prepared.read_bytes())
    blob[-1] ^= 1
    flipped.write_bytes(bytes(blob))
    assert run_id(inputs_for(data=flipped)) != run_id(inputs_for())


def test_one_package_version_changes_the_run_id(inputs_for) -> None:
    env = capture_environment(ROOT / "requirements-cpu.lock")
    changed = copy.deepcopy(env)
    changed["torch"]["version"] = "2.13.1"
    assert run_id(inputs_for(env=changed)) != run_id(inputs_for(env=env))


def test_one_line_of_code_changes_the_code_hash(tmp_path: Path) -> None:
    files = [tmp_path / "a.py", tmp_path / "b.py"]
    for f in files:
        f.write_text("x = 1\n")
    before = code_hash(files, tmp_path)
    files[1].write_text("x = 1\ny = 2\n")
    assert code_hash(files, tmp_path) != before


def test_stage_source_files_are_its_import_closure() -> None:
    names = {f.name for f in source_files("reprotrain.pipeline.stages.train")}
    assert {"train.py", "training.py", "recipe.py", "determinism.py", "run_record.py"} <= names
    assert "digits.py" not in names  # the recipe params names: its code is hashed apart
    assert "cli.py" not in names and "evaluate.py" not in names
    # The op recorder observes and never decides the bits: loaded by name, not hashed.
    assert "recorder.py" not in names


def test_checksum_mismatch_names_both_checksums(tmp_path: Path) -> None:
    data = tmp_path / "d.bin"
    data.write_bytes(b"abc")
    (tmp_path / "d.bin.dvc").write_text(f"outs:\n- md5: {md5_file(data)}\n  path: d.bin\n")
    assert verify_dvc_checksum(data, tmp_path / "dvc.lock")[1] == md5_file(data)
    recorded = md5_file(data)
    data.write_bytes(b"abd")
    with pytest.raises(ChecksumError, match=f"md5 {md5_file(data)} does not match {recorded}"):
        verify_dvc_checksum(data, tmp_path / "dvc.lock")


def test_a_dvc_lock_that_is_not_dvcs_yaml_is_one_checksum_error(tmp_path: Path) -> None:
    data = tmp_path / "d.bin"
    data.write_bytes(b"abc")
    lock = tmp_path / "dvc.lock"
    for text, _ in BAD_DVC_LOCK.values():
        lock.write_text(text)
        with pytest.raises(ChecksumError, match=r"restore it from git or rerun `dvc repro`$"):
            verify_dvc_checksum(data, lock)
    # Control: a lock that records nothing for the file holds it to nothing.
    lock.write_text("schema: '2.0'\nstages: {}\n")
    assert verify_dvc_checksum(data, lock) == (md5_file(data), None)


def test_a_lock_in_a_subfolder_is_read_against_each_stages_wdir(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"  # the repository root: the stage's wdir
    data.write_bytes(b"abc")
    pipeline = tmp_path / "pipelines" / "mine"
    pipeline.mkdir(parents=True)
    (pipeline / "dvc.yaml").write_text("stages:\n  prepare:\n    wdir: ../..\n    cmd: x\n")
    lock = pipeline / "dvc.lock"
    lock.write_text(
        f"stages:\n  prepare:\n    outs:\n    - path: data.bin\n      md5: {md5_file(data)}\n"
    )
    assert verify_dvc_checksum(data, lock) == (md5_file(data), md5_file(data))
    data.write_bytes(b"abd")
    with pytest.raises(ChecksumError, match="does not match"):
        verify_dvc_checksum(data, lock)
    # Control: without the dvc.yaml that names the wdir, the lock places nothing there.
    (pipeline / "dvc.yaml").unlink()
    assert verify_dvc_checksum(data, lock)[1] is None


# --- through DVC ---------------------------------------------------------------------------


def test_fingerprint_prints_the_run_id_of_the_last_run(dvc_repo: Path) -> None:
    recorded = json.loads((dvc_repo / "reports/run.json").read_text())
    printed = run_checked("reprotrain", "run-id", cwd=dvc_repo).strip().splitlines()[-1]
    assert printed == recorded["run_id"]
    other = run_checked("reprotrain", "run-id", "-S", "train.max_epochs=3", cwd=dvc_repo)
    assert other.strip().splitlines()[-1] != printed


def test_run_id_refuses_when_the_data_it_would_hash_is_about_to_be_remade(dvc_repo: Path) -> None:
    # seed is a param of prepare too: another seed splits the data otherwise, so the data on
    # disk is not what the train stage would read
    stale = run_cli("run-id", "--seed", "1", cwd=dvc_repo)
    assert stale.returncode == 2, stale.stdout
    assert stale.stderr.strip().splitlines()[-1] == (
        "reprotrain: error: data/prepared/dataset.safetensors is made by stage 'prepare', "
        "whose params changed since dvc.lock recorded it (seed: 42 -> 1), so the train stage "
        "would read other data; run `dvc repro` (or `dvc exp run` with these -S) first, whose "
        "run.json holds the run ID"
    )
    # Control: a param of train alone prints an ID (the test above)


def test_run_id_of_the_lm_pipeline_reads_its_own_stage_command(dvc_repo: Path) -> None:
    # the stage's cmd names --params, which the stage parser must take as the CLI does
    lm = dvc_repo / "pipelines/lm"
    recorded = json.loads((lm / "reports/run.json").read_text())["run_id"]
    argv = ["run-id", "--dvc-yaml", "pipelines/lm/dvc.yaml", "--params", "pipelines/lm/params.yaml"]
    printed = run_checked("reprotrain", *argv, cwd=dvc_repo).strip().splitlines()[-1]
    assert printed == recorded
    # control: params.yaml (the digits recipe's) is not what that stage reads: one line
    wrong = run_cli("run-id", "--dvc-yaml", "pipelines/lm/dvc.yaml", cwd=dvc_repo)
    assert wrong.returncode == 2
    assert "pass --params pipelines/lm/params.yaml" in wrong.stderr.strip().splitlines()[-1]


def test_dvc_md5_is_our_md5(dvc_repo: Path) -> None:
    path = dvc_repo / "data/prepared/dataset.safetensors"
    assert verify_dvc_checksum(path, dvc_repo / "dvc.lock") == (md5_file(path), md5_file(path))


@pytest.mark.slow
def test_environment_change_retrains_and_no_change_does_not(repo_copy: Path) -> None:
    unchanged = run_checked("dvc", "repro", cwd=repo_copy)
    assert "Stage 'train' didn't change, skipping" in unchanged
    # A variable that decides kernels and that the CPU profile does not set itself.
    changed = run_checked("dvc", "repro", cwd=repo_copy, NVIDIA_TF32_OVERRIDE="0")
    assert "Running stage 'train'" in changed or "Stage 'train' is cached" not in changed
    assert "Running stage 'train'" in changed


def test_flipped_data_byte_is_refused_and_nothing_written(repo_copy: Path) -> None:
    data = repo_copy / "data/prepared/dataset.safetensors"
    recorded = md5_file(data)
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    outputs = ["models/model.safetensors", "reports/run.json", "reports/train_metrics.json"]
    before = {name: (repo_copy / name).read_bytes() for name in outputs}
    result = run_cli(*stage_argv(repo_copy, "train"), cwd=repo_copy)
    assert result.returncode == 2
    message = result.stderr.strip()
    assert "data/prepared/dataset.safetensors" in message
    assert md5_file(data) in message and recorded in message
    assert {name: (repo_copy / name).read_bytes() for name in outputs} == before


def test_remote_round_trip_restores_bits_without_retraining(
    repo_copy: Path, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    run_checked("dvc", "remote", "add", "-d", "store", remote, cwd=repo_copy)
    run_checked("dvc", "push", cwd=repo_copy)
    commit_all(repo_copy, "remote")
    clone = tmp_path / "clone"
    run_checked("git", "clone", "-q", repo_copy, clone, cwd=tmp_path)
    run_checked("dvc", "pull", cwd=clone)
    for name in ("models/model.safetensors", "data/prepared/dataset.safetensors"):
        assert (clone / name).read_bytes() == (repo_copy / name).read_bytes()
    status = run_checked("dvc", "status", cwd=clone)
    always = ["env:", "\talways changed"]
    for lm in ("lm-compiled", "lm"):  # dvc status lists them sorted
        always += [f"pipelines/{lm}/dvc.yaml:env:", "\talways changed"]
    assert [line for line in status.splitlines() if line.strip()] == always
    repro = run_checked("dvc", "repro", cwd=clone)
    assert "Running stage 'train'" not in repro and "Running stage 'prepare'" not in repro


def _checklist(repo: Path, *extra: str) -> tuple[int, dict[str, str]]:
    result = run_cli("checklist", "--json", *extra, cwd=repo)
    items = json.loads(result.stdout)
    return result.returncode, {f"{i['category']}/{i['name']}": i["status"] for i in items}


def test_checklist_on_a_clean_tree_has_no_failures(dvc_repo: Path) -> None:
    code, items = _checklist(dvc_repo, "--strict")
    assert code == 0, items
    assert "fail" not in items.values()
    assert items["environment/image digest known"] == "warn"  # not in a container here


def test_checklist_reports_a_dirty_tree(repo_copy: Path) -> None:
    (repo_copy / "src/reprotrain/recipes/digits.py").write_text("# edited\n", encoding="utf-8")
    code, items = _checklist(repo_copy, "--strict")
    assert items["code/clean tree"] == "fail" and code == 1


def test_checklist_reports_a_drifted_package(repo_copy: Path) -> None:
    lock = repo_copy / "requirements-cpu.lock"
    lock.write_text(lock.read_text().replace("\nnumpy==", "\nnumpy==0.0.1-was-"))
    code, items = _checklist(repo_copy, "--strict")
    assert items["environment/lock installed exactly"] == "fail" and code == 1


def test_checklist_reports_a_missing_hash_seed(repo_copy: Path) -> None:
    path = repo_copy / "reports/run.json"
    record = json.loads(path.read_text())
    record["inputs"]["determinism"]["hash_seed_fixed_at_start"] = False
    path.write_text(json.dumps(record))
    commit_all(repo_copy, "a run made without a fixed hash seed")
    code, items = _checklist(repo_copy, "--strict")
    assert items["random state/hash seed fixed at start"] == "fail" and code == 1
    assert items["code/clean tree"] == "pass"


def test_two_spellings_of_one_config_are_one_run(inputs_for) -> None:
    """The run ID hashes model and data as resolved: `1e-3` (a string to PyYAML) is 0.001."""
    spelt = run_id(inputs_for(["model.init_args.lr=1e-3"]))
    assert spelt == run_id(inputs_for(["model.init_args.lr=0.001"]))
    assert run_id(inputs_for(["model.init_args.lr=0.005"])) == run_id(inputs_for())  # default
    assert spelt != run_id(inputs_for(["model.init_args.lr=0.002"]))  # control: another value


@pytest.fixture
def pipeline_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory: this dvc.yaml and params.yaml, no git, no outputs."""
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setenv("REPROTRAIN_LOCK", str(ROOT / "requirements-cpu.lock"))
    monkeypatch.delenv("DVC_STAGE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


#: A dvc.lock that DVC never writes -> what checklist's one error line says of it.
BAD_DVC_LOCK = {
    "bad YAML": ("stages: [\n", r"not valid YAML \(line 2\)"),
    "a list at the top": ("- stages\n", "expected a mapping at the top level"),
    "an out with no path": (
        "stages:\n  train:\n    outs: [{md5: abc}]\n",
        "stage 'train': `outs` is not a list of entries with a path",
    ),
    "an empty stage": ("stages:\n  train: null\n", r"stage 'train' is not a mapping \(outs.*\)"),
}


@pytest.mark.parametrize("case", BAD_DVC_LOCK)
def test_checklist_names_a_corrupt_dvc_lock_in_one_line(pipeline_folder: Path, case: str) -> None:
    text, expect = BAD_DVC_LOCK[case]
    (pipeline_folder / "dvc.lock").write_text(text, encoding="utf-8")
    result = run_in_process("checklist", "--json")
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    what_to_do = "; restore it from git or rerun `dvc repro`"
    assert re.fullmatch(rf"reprotrain: error: dvc\.lock: {expect}{re.escape(what_to_do)}", line)
    assert json.loads(result.stdout) == {"error": line.split(": ", 2)[2], "exit_code": 2}


def test_checklist_checks_the_outputs_a_good_dvc_lock_records(pipeline_folder: Path) -> None:
    """Negative control: a well-formed dvc.lock is read, and a changed output is a fail."""
    out = pipeline_folder / "out.bin"
    out.write_bytes(b"weights")
    entry = {"path": "out.bin", "hash": "md5", "md5": md5_file(out)}
    lock = {"schema": "2.0", "stages": {"train": {"cmd": "x", "outs": [entry]}, "env": {}}}
    (pipeline_folder / "dvc.lock").write_text(json.dumps(lock), encoding="utf-8")

    def data_item() -> tuple[int, str, str]:
        result = run_in_process("checklist", "--json")
        [item] = [i for i in json.loads(result.stdout) if i["category"] == "data"]
        return result.returncode, item["status"], item["detail"]

    assert data_item() == (0, "pass", "1 files match")
    out.write_bytes(b"other weights")
    assert data_item() == (0, "fail", "changed: out.bin")


def test_a_copy_of_the_repository_runs_and_hashes_its_own_code(repo_copy: Path) -> None:
    """As DVC runs a queued or --temp experiment: in a copy, with the install (editable, of
    the checkout) importing the checkout's code unless the copy's own is put first."""
    plain = {"REPROTRAIN_ZYGOTE": ""}  # a real restart, as a user's command has

    def run_id() -> str:
        return run_checked("reprotrain", "run-id", cwd=repo_copy, **plain).strip().splitlines()[-1]

    before = run_id()
    stage = repo_copy / "src/reprotrain/pipeline/stages/train.py"
    original = stage.read_text()
    stage.write_text(original + "\n# an edit in the copy alone\n")
    assert run_id() != before
    stage.write_text(original)
    assert run_id() == before  # control: its code as it was, its ID as it was
