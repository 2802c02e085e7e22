"""`reprotrain verify`, `compare` and `locate` end to end, in fresh processes.

The non-deterministic runs come from tests/inject/sitecustomize.py: a layer whose backward
pass adds unseeded noise from step k on, loaded into every process the test starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import ROOT, RUN_OUTPUTS, commit_all, run_cli, verify_training
from tests.test_oprecord import _line_of

INJECT = str(ROOT / "tests" / "inject")
MODEL = ROOT / "src" / "reprotrain" / "recipes" / "digits.py"


def _shorten(repo: Path, **train: object) -> None:
    """Fewer epochs (and any other train.* values) in the copy's params.yaml."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"].update({"max_epochs": 1, **train})
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.slow
def test_verify_reruns_and_finds_them_identical(repo_copy: Path, tmp_path: Path) -> None:
    _shorten(repo_copy)
    result = run_cli("verify", "--runs", "3", "--workdir", tmp_path / "w", cwd=repo_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "IDENTICAL (3 runs)" in result.stdout
    assert result.stdout.count("IDENTICAL: the same bits") == 2


@pytest.mark.slow
def test_verify_names_the_step_record_and_op_of_injected_noise(
    repo_copy: Path, tmp_path: Path
) -> None:
    _shorten(repo_copy, trace="full")
    work = tmp_path / "w"
    result = run_cli(
        "verify",
        *("--workdir", work, "--json"),
        cwd=repo_copy,
        PYTHONPATH=INJECT,
        REPROTRAIN_TEST_NOISE_FROM_STEP="5",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["identical"] is False
    trace = report["comparisons"][0]["trace"]
    assert (trace["first_step"], trace["record"]) == (5, "grads")
    assert "backward" in trace["diagnosis"] and trace["tensor"] == "net.0.weight"
    assert (work / "loss-run-2.png").read_bytes().startswith(b"\x89PNG")
    # a kernel is blamed: both runs trained again recording step 5's ops, which name the op
    op = report["comparisons"][0]["ops"]
    assert op["kind"] == "inputs" and op["op"]["step"] == 5 and op["op"]["phase"] == "backward"
    assert "random generator's state" in op["differing_inputs"][0]
    # the noise layer's backward (net.8, after the first Linear), at the line calling the network
    assert op["op"]["op"].startswith("aten.randn") and op["op"]["module"] == "net.8"
    assert op["op"]["line"].endswith(f"digits.py:{_line_of('return self.net(x)', MODEL)}")

    # One diagnosis: the trace's headline is the recording's (the RNG state going into
    # randn), not the kernel the fingerprints alone would suggest.
    assert "aten.randn" in trace["diagnosis"] and "kernel" not in trace["diagnosis"]
    # compare on the kept folders says the same, in words: it finds verify's recordings.
    text = run_cli("compare", work / "run-1", work / "run-2", cwd=repo_copy)
    assert text.returncode == 1
    assert "traces diverge at step 5 (row 5): grads differs first" in text.stdout
    assert "first differing op: aten.randn" in text.stdout
    assert "non-deterministic kernel" not in text.stdout


@pytest.mark.slow
def test_verify_against_a_revision_with_another_environment_reruns_instead(
    repo_copy: Path, tmp_path: Path
) -> None:
    _shorten(repo_copy)
    env_file = repo_copy / "reports/environment.json"
    env = json.loads(env_file.read_text())
    env["torch"]["version"] = "0.0.0-elsewhere"
    env_file.write_text(json.dumps(env))
    commit_all(repo_copy, "an environment recorded elsewhere")
    result = run_cli("verify", "--against", "HEAD", cwd=repo_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the bitwise guarantee does not apply there" in result.stdout
    assert "torch.version" in result.stdout and "IDENTICAL (2 runs)" in result.stdout


@pytest.mark.slow
def test_verify_against_the_committed_run_reproduces_it(repo_copy: Path) -> None:
    result = run_cli("verify", "--against", "HEAD", cwd=repo_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "a: HEAD" in result.stdout and "same run ID" in result.stdout
    assert "IDENTICAL: the same bits" in result.stdout


def test_compare_revisions_reads_dvc_outputs_and_explains_params(repo_copy: Path) -> None:
    same = run_cli("compare", "HEAD", repo_copy, "--json", cwd=repo_copy)
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["identical"] is True
    missing = run_cli("compare", "HEAD", "no-such-rev", cwd=repo_copy)
    assert missing.returncode == 2
    assert "no-such-rev: neither a folder nor a git revision" in missing.stderr


@pytest.mark.parametrize("noise", [True, False])
def test_locate_names_the_injected_layer_and_nothing_without_it(
    noise: bool, prepared: Path
) -> None:
    inject = {"PYTHONPATH": INJECT, "REPROTRAIN_TEST_NOISE_FROM_STEP": "0"} if noise else {}
    result = run_cli(
        *("locate", "--params", ROOT / "params.yaml", "-S", f"data.init_args.path={prepared}"),
        cwd=ROOT,
        **inject,
    )
    if noise:
        assert result.returncode == 1, result.stderr
        assert "backward differs first at net.8 (NoisyGrad)" in result.stdout
    else:
        assert result.returncode == 0, result.stderr
        assert "identical" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_twin_two_fresh_gpu_trainings_give_identical_bits(
    prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    # Fresh processes, so the determinism flags and CUBLAS_WORKSPACE_CONFIG are in force
    # before CUDA starts; the CPU test is tests/test_train.py's same-seed test. The
    # negative control on CUDA: tests/test_oprecord.py's index_add_ with determinism off.
    report = verify_training(
        prepared, env_record, tmp_path / "w", "-S", "train.accelerator=gpu",
        "-S", "train.max_epochs=1",
    )  # fmt: skip
    assert report["identical"], report
    assert sorted(report["outputs"]) == sorted(RUN_OUTPUTS), report


def test_verify_that_fails_leaves_no_temporary_folder(repo_copy: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = run_cli(
        "verify", "-S", "model.init_args.dropout=1.5", cwd=repo_copy, TMPDIR=str(scratch)
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model.init_args.dropout" in result.stderr
    assert not list(scratch.glob("reprotrain-verify-*"))


def test_the_verdict_names_which_pairs_of_runs_differ() -> None:
    from types import SimpleNamespace

    from reprotrain.commands.verify import _verdict

    def pair(b: str, identical: bool) -> SimpleNamespace:
        return SimpleNamespace(a=SimpleNamespace(label="run-1"), b=SimpleNamespace(label=b),
                               identical=identical)  # fmt: skip

    assert _verdict([pair("run-2", True), pair("run-3", True)]) == "IDENTICAL (3 runs)"
    assert _verdict([pair("run-2", True), pair("run-3", False)]) == (
        "NOT REPRODUCIBLE (3 runs; differ: run-1 vs run-3)"
    )


def test_world_sizes_take_words_or_a_comma_list_and_refuse_other_text() -> None:
    from reprotrain.cli import build_parser

    parser = build_parser()
    for words in (["1", "2", "4"], ["1,2,4"], ["1,2", "4"]):
        assert parser.parse_args(["verify", "--world-sizes", *words]).world_sizes == [1, 2, 4]
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["verify", "--world-sizes", "1,x"])
    assert refused.value.code == 2


def test_a_workdir_holding_earlier_runs_is_refused_before_anything_is_deleted(
    tmp_path: Path,
) -> None:
    work = tmp_path / "W"
    (work / "run-1").mkdir(parents=True)
    (work / "run-1" / "notes.txt").write_text("mine\n")
    (work / "environment.json").write_text("{}\n")
    done = run_cli("verify", "--workdir", work, "-S", "train.accelerator=gpu", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == (
        f"reprotrain: error: --workdir {work}: already holds environment.json and 1 more from "
        "before; name an empty or new folder (verify never deletes runs)\n"
    )
    assert (work / "run-1" / "notes.txt").read_text() == "mine\n"
    assert (work / "environment.json").read_text() == "{}\n"
    # control: an empty workdir passes, and the next check (no dvc.yaml here) speaks
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_cli("verify", "--workdir", empty, cwd=tmp_path)
    assert done.returncode == 2 and "--workdir" not in done.stderr, done.stderr
    assert done.stderr.startswith("reprotrain: error: dvc.yaml: not found")


def test_a_workdir_that_is_a_file_is_refused_by_the_pipeline_and_reference_modes(
    tmp_path: Path,
) -> None:
    file = tmp_path / "FILE"
    file.write_text("not a folder\n")
    for mode in ((), ("--reference", "HEAD")):
        for workdir, said in ((file, "is a file"), (file / "sub", "cannot make it")):
            done = run_cli("verify", *mode, "--workdir", workdir, cwd=tmp_path)
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            assert done.stderr.startswith(f"reprotrain: error: --workdir {workdir}: {said}")
            assert done.stderr.count("\n") == 1
    # control: a missing folder is made, and the clone goes in it (here: no repository)
    missing = tmp_path / "a" / "missing" / "dir"
    done = run_cli("verify", "--reference", "HEAD", "--workdir", missing, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("reprotrain: error: git clone -q --no-checkout")
    assert f"{missing}/reprotrain-reference-" in done.stderr
    assert missing.is_dir() and not list(missing.iterdir())  # the failed clone is removed


def test_a_rerun_trains_with_the_stages_own_params_file() -> None:
    # verify --dvc-yaml pipelines/lm/dvc.yaml: its train stage reads pipelines/lm/params.yaml
    from reprotrain.commands._rerun import _train_command
    from reprotrain.pipeline.command import stage_arguments

    lm = stage_arguments("train", ROOT / "pipelines/lm/dvc.yaml")
    argv = _train_command(lm, Path("run-0"), Path("env.json"), ["seed=3"])
    assert argv[argv.index("--params") + 1] == "pipelines/lm/params.yaml"
    assert argv[-2:] == ["-S", "seed=3"]  # the user's overrides last, so they win
    # control: the default pipeline's stage names no params file: params.yaml
    digits = stage_arguments("train", ROOT / "dvc.yaml")
    argv = _train_command(digits, Path("run-0"), Path("env.json"), [])
    assert argv[argv.index("--params") + 1] == "params.yaml"
