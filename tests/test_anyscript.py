"""``reprotrain verify -- CMD`` on small plain scripts: a verdict for every file, its own exit code.

Each script is written by the test and runs in seconds; the weights come from
safetensors' NumPy writer, so no run imports torch unless the test needs a
``torch.save`` checkpoint. Exit codes: 0 IDENTICAL, 1 NOT REPRODUCIBLE,
2 bad input, 4 DIFFERS OUTSIDE TENSORS, 5 UNREADABLE.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from reprotrain.commands._anyscript import _when_ops_match
from reprotrain.commands._runlog import failure_line
from reprotrain.ops.opfile import load_recordings
from tests.helpers import run_cli

#: Writes weights (10 tensors, the last ``DIFFER`` of them shifted by the run's number),
#: a log (the run's number in it when ``LOG`` is set) and a config naming the run folder.
SCRIPT = """
import os, sys
import numpy as np
from safetensors.numpy import save_file
out, run = sys.argv[1], int(os.environ["REPROTRAIN_RUN_INDEX"])
differ = int(os.environ.get("DIFFER", "0"))
save_file({f"w{i:02d}": np.full(4, float(run if i >= 10 - differ else 0)) for i in range(10)},
          f"{out}/model.safetensors")
with open(f"{out}/train.log", "w") as log:
    log.write(f"run {run if os.environ.get('LOG') else 0}: loss 0.5\\n")
os.makedirs(f"{out}/.hydra")
with open(f"{out}/.hydra/config.yaml", "w") as config:
    config.write(f"run_dir: {out}\\n")
"""


def _verify(tmp_path: Path, *args: str, script: str = SCRIPT, **env: str):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "train.py"
    path.write_text(script)
    work = tmp_path / "runs"
    return run_cli(
        "verify", "--workdir", work, *args, "--", sys.executable, path, "{out}", cwd=tmp_path, **env
    )


def test_a_command_that_writes_nothing_is_a_usage_error_not_a_pass(tmp_path: Path) -> None:
    done = run_cli("verify", "--", sys.executable, "-c", "print('hi')", cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    assert "IDENTICAL" not in done.stdout
    error = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "wrote nothing under {out}" in error[0]
    assert "--output" not in error[0]  # it names files under {out}: no help here
    # each run says when it started and how long it took, while verify waits
    assert "run 0 started at" in done.stderr and "run 1 finished in" in done.stderr


def test_a_script_writing_the_same_files_is_identical(tmp_path: Path) -> None:
    done = _verify(tmp_path)  # negative control of the tests below: the config's path differs
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("reprotrain verify: IDENTICAL: 2 runs, .hydra/config.yaml")


def test_a_differing_log_line_alone_does_not_make_the_weights_different(tmp_path: Path) -> None:
    done = _verify(tmp_path, LOG="1")
    assert done.returncode == 4, done.stdout + done.stderr
    assert done.stdout.splitlines()[:3] == [
        f"reprotrain verify: DIFFERS OUTSIDE TENSORS: {sys.executable} {tmp_path / 'train.py'} "
        "'{out}'",
        "  every tensor is equal; these files differ outside tensors:",
        "  train.log (file): differs (text, line 1: 'run 0: loss 0.5' vs 'run 1: loss 0.5')",
    ]
    assert "model.safetensors" in done.stdout.splitlines()[3]  # listed as identical
    assert "Traceback" not in done.stderr


def test_differing_weights_are_not_reproducible_and_the_table_counts_what_it_left_out(
    tmp_path: Path,
) -> None:
    done = _verify(tmp_path, "--json", DIFFER="10", LOG="1")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "NOT REPRODUCIBLE" and not report["identical"]
    files = {f["name"]: f for f in report["files"]}
    assert files["model.safetensors"]["status"] == "tensors"
    assert files["train.log"]["status"] == "bytes"  # named beside, with its own status
    text = run_cli(
        "verify", "--workdir", tmp_path / "text", "--", sys.executable, tmp_path / "train.py",
        "{out}", cwd=tmp_path, DIFFER="10",
    )  # fmt: skip
    lines = text.stdout.splitlines()
    assert "  model.safetensors (safetensors): 10 of 10 tensors differ" in lines
    assert "    ... and 2 more" in lines
    assert "    w07: different, max |a-b| 1, rel L2 inf" in lines


CHECKPOINT = """
import os, sys, torch
out, run = sys.argv[1], int(os.environ["REPROTRAIN_RUN_INDEX"])
plant = float(run) if os.environ.get("PLANT") else 0.0
torch.save({"state_dict": {"w": torch.ones(3), "b": torch.zeros(2) + plant},
            "optimizer_states": [{"state": {0: {"step": 3}}}], "dirpath": out},
           f"{out}/last.ckpt")
if os.environ.get("GARBAGE"):
    open(f"{out}/best.ckpt", "wb").write(os.urandom(64))
"""


def test_a_differing_tensor_inside_a_ckpt_is_found(tmp_path: Path) -> None:
    same = _verify(tmp_path / "same", "--output", "last.ckpt", script=CHECKPOINT)
    assert same.returncode == 0, same.stdout + same.stderr  # its dirpath is its own {out}
    planted = _verify(tmp_path / "plant", "--output", "last.ckpt", script=CHECKPOINT, PLANT="1")
    assert planted.returncode == 1, planted.stdout + planted.stderr
    assert "  last.ckpt (checkpoint): 1 of 2 tensors differ" in planted.stdout.splitlines()
    assert "    state_dict/b: different, max |a-b| 1, rel L2 inf" in planted.stdout.splitlines()


def test_an_unreadable_file_is_named_and_is_not_the_not_reproducible_code(tmp_path: Path) -> None:
    done = _verify(tmp_path, script=CHECKPOINT, GARBAGE="1")
    assert done.returncode == 5, done.stdout + done.stderr
    assert done.stdout.startswith("reprotrain verify: UNREADABLE: ")
    assert (
        f"  best.ckpt (checkpoint): unreadable: {tmp_path / 'runs' / 'run-0' / 'best.ckpt'}: "
        in (done.stdout)
    )
    assert "identical: last.ckpt" in done.stdout  # the readable file still has its verdict
    assert "Traceback" not in done.stderr


HYDRA_FAILURE = """
print("Error executing job with overrides: []")
print("Traceback (most recent call last):")
print('  File "train.py", line 3, in main')
print("ValueError: lr must be > 0")
print()
print("Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.")
raise SystemExit(1)
"""


def test_a_failed_run_is_reported_by_its_error_not_its_last_log_line(tmp_path: Path) -> None:
    done = _verify(tmp_path, script=HYDRA_FAILURE)
    assert done.returncode == 2
    assert "(ValueError: lr must be > 0)" in done.stderr
    assert "HYDRA_FULL_ERROR" not in done.stderr


def test_the_failure_line_is_the_last_tracebacks_end_or_a_named_exception() -> None:
    chained = (
        "Traceback (most recent call last):\n  x\nKeyError: 'a'\n\n"
        "Traceback (most recent call last):\n  y\nRuntimeError: b\nmore\n"
    )
    assert failure_line(chained) == "RuntimeError: b"
    assert failure_line("loading\nCUDA Error: out of memory\nbye\n") == "CUDA Error: out of memory"
    assert failure_line("loading\nkilled\n\n") == "killed"  # negative control: nothing named
    hydra_override = (
        "Could not override 'lr'.\nTo append to your config use +lr=0.1\n"
        "Key 'lr' is not in struct\n    full_key: lr\n    object_type=dict\n\n"
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"
    )
    assert failure_line(hydra_override) == (
        "Could not override 'lr'. To append to your config use +lr=0.1 Key 'lr' is not in struct"
    )
    assert failure_line("") == "(no output)"


def test_pipeline_options_are_refused_with_a_command_and_command_options_without(
    tmp_path: Path,
) -> None:
    done = _verify(tmp_path, "--jobs", "2", "-S", "model.init_args.lr=0.1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("reprotrain: error: --jobs, -S: not with `-- CMD`")
    assert not (tmp_path / "runs").exists()  # refused before any run
    alone = run_cli("verify", "--output", "model.safetensors", cwd=tmp_path)
    assert alone.returncode == 2 and "--output: only with `-- CMD`" in alone.stderr


BAD_TRACE = """
import json, os, sys
import numpy as np
from safetensors.numpy import save_file
out, run = sys.argv[1], int(os.environ["REPROTRAIN_RUN_INDEX"])
save_file({"w": np.full(2, float(run))}, f"{out}/model.safetensors")
meta = {"reprotrain": json.dumps({"format": "reprotrain.trace"})}  # says trace, is not one
save_file({"step": np.arange(3)}, f"{out}/trace.safetensors", metadata=meta)
if run == 1 and os.environ.get("TRUNCATE"):
    data = open(f"{out}/trace.safetensors", "rb").read()
    open(f"{out}/trace.safetensors", "wb").write(data[:-5])
"""


def test_a_trace_that_cannot_be_read_still_leaves_the_weights_verdict(tmp_path: Path) -> None:
    outputs = {}
    for name, env in (("truncated", {"TRUNCATE": "1"}), ("fake", {})):
        done = _verify(tmp_path / name, script=BAD_TRACE, **env)
        assert done.returncode == 1, done.stdout + done.stderr  # the weights differ: that decides
        assert "  model.safetensors (safetensors): 1 of 1 tensors differ" in done.stdout
        assert "Traceback" not in done.stderr
        outputs[name] = done.stdout
    run_1 = tmp_path / "truncated" / "runs" / "run-1" / "trace.safetensors"
    assert f"  trace.safetensors (safetensors): unreadable: {run_1}: " in outputs["truncated"]
    # the same bytes in both runs, a safetensors file, but no trace inside
    assert "  trace.safetensors: not readable as a trace (" in outputs["fake"]


ONE_SIDED = """
import os, sys
import numpy as np
from safetensors.numpy import save_file
out, run = sys.argv[1], int(os.environ["REPROTRAIN_RUN_INDEX"])
save_file({"w": np.zeros(2)}, f"{out}/model.safetensors")
open(f"{out}/events.{os.getpid()}", "w").write("step 0\\n")  # as TensorBoard names its file
if run == 0 and os.environ.get("EXTRA_WEIGHTS"):
    save_file({"w": np.zeros(2)}, f"{out}/extra.safetensors")
"""


def test_a_file_only_one_run_wrote_is_a_verdict_not_an_error(tmp_path: Path) -> None:
    done = _verify(tmp_path / "log", script=ONE_SIDED)
    assert done.returncode == 4, done.stdout + done.stderr
    one_sided = [line for line in done.stdout.splitlines() if "events." in line]
    assert len(one_sided) == 2 and all(
        "(file): differs (not written by run " in x for x in one_sided
    )
    weights = _verify(tmp_path / "weights", script=ONE_SIDED, EXTRA_WEIGHTS="1")
    assert weights.returncode == 1, weights.stdout + weights.stderr
    assert "  extra.safetensors (safetensors): not written by run 1" in weights.stdout
    named = _verify(tmp_path / "named", "--output", "extra.safetensors", script=ONE_SIDED,
                    EXTRA_WEIGHTS="1")  # fmt: skip
    assert named.returncode == 2 and "the command did not write extra.safetensors" in named.stderr


HYDRA_APP = """
import logging, os
import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from safetensors.numpy import save_file

@hydra.main(version_base=None, config_path=None)
def main(cfg) -> None:
    logging.getLogger(__name__).info("training")  # a timestamped line in the run's log
    if os.environ.get("BOOM"):
        raise ValueError("lr must be > 0")
    save_file({"w": np.zeros(3)}, f"{HydraConfig.get().runtime.output_dir}/model.safetensors")

main()
"""


def test_a_hydra_app_needs_its_run_dir_and_its_log_alone_differs(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(HYDRA_APP)
    verify = ("verify", "--workdir", tmp_path / "runs", "--", sys.executable, app)
    own_folder = run_cli(*verify, cwd=tmp_path)  # writes into outputs/<date>/<time>
    assert own_folder.returncode == 2 and "hydra.run.dir={out}" in own_folder.stderr
    verify = ("verify", "--workdir", tmp_path / "runs2", "--", sys.executable, app)
    done = run_cli(*verify, "hydra.run.dir={out}", cwd=tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[2].startswith("  app.log (file): differs (text, line 1: ")
    # .hydra/hydra.yaml holds each run's folder: equal with the folder as {out}
    assert lines[3].startswith("  identical: .hydra/config.yaml, .hydra/hydra.yaml")
    verify = ("verify", "--workdir", tmp_path / "runs3", "--", sys.executable, app)
    failed = run_cli(*verify, "hydra.run.dir={out}", cwd=tmp_path, BOOM="1")
    assert failed.returncode == 2 and "(ValueError: lr must be > 0)" in failed.stderr


UNPOOL = """
import sys
import torch
from torch.nn import functional as F
from reprotrain.determinism import configure_determinism

{setup}
out, indices = F.max_pool2d(torch.randn(1, 1, 4, 4), 2, return_indices=True)
F.max_unpool2d(out, indices, 2)
"""


def test_an_op_without_a_deterministic_kernel_is_named_with_its_line_and_the_choices(
    tmp_path: Path,
) -> None:
    """torch's alert (max_unpool2d on CPU) becomes the library's line, uncut, in verify and
    run; a script that set torch's flag itself gets the same line from its traceback."""
    for setup in ("configure_determinism(0, True)", "torch.use_deterministic_algorithms(True)"):
        done = _verify(tmp_path / setup[:9], script=UNPOOL.format(setup=setup))
        assert done.returncode == 2, done.stdout + done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert "max_unpool" in line and "train.py:9)" in line, line
        assert "warn mode (deterministic: warn" in line and "reruns may differ; see " in line
    script = tmp_path / "plain.py"
    script.write_text(UNPOOL.format(setup="configure_determinism(0, True)"))
    done = run_cli("run", "--", sys.executable, script, cwd=tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("reprotrain: DeterminismError: max_unpool") and "plain.py:9)" in last
    # The control: without determinism the op runs and nothing is added.
    script.write_text(UNPOOL.format(setup="").replace("F.max_unpool2d", "raise SystemExit(3) #"))
    assert (
        "DeterminismError" not in run_cli("run", "--", sys.executable, script, cwd=tmp_path).stderr
    )


#: A checkpoint as a Hydra template's writes one: the model's ``net`` (a class of the
#: script's own) kept by save_hyperparameters, and the run folder among its fields.
OBJECT_CHECKPOINT = """
import sys
import torch
out = sys.argv[1]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


torch.manual_seed(0)
net = Net()
torch.save({"state_dict": net.state_dict(), "hyper_parameters": {"net": net, "dir": out}},
           f"{out}/last.ckpt")
"""


def test_a_checkpoint_holding_the_scripts_own_classes_is_compared_without_running_them(
    tmp_path: Path,
) -> None:
    done = _verify(tmp_path, script=OBJECT_CHECKPOINT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "reprotrain verify: IDENTICAL: 2 runs, last.ckpt"
    assert "read without running its code: __main__.Net, " in lines[1], lines


def test_runs_that_proved_identical_leave_no_folder_unless_a_workdir_was_named(
    tmp_path: Path,
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    argv = ("verify", "--", sys.executable, tmp_path / "train.py", "{out}")
    done = run_cli(*argv, cwd=tmp_path, TMPDIR=str(scratch))
    assert done.returncode == 0 and "runs kept in" not in done.stdout
    assert list(scratch.iterdir()) == []
    differs = run_cli(*argv, cwd=tmp_path, TMPDIR=str(scratch), DIFFER="1")  # control
    assert differs.returncode == 1 and "runs kept in" in differs.stdout
    assert len(list(scratch.iterdir())) == 1


def _error_lines(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("reprotrain: error:")]


def test_an_output_outside_the_run_folder_is_refused_before_any_run(tmp_path: Path) -> None:
    for name in ("/etc/hostname", "../../../../etc/hostname"):
        work = tmp_path / "runs"
        done = run_cli("verify", "--workdir", work, "--output", name, "--", "true", cwd=tmp_path)
        assert done.returncode == 2 and "IDENTICAL" not in done.stdout, done.stdout
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
        assert done.stderr.startswith(f"reprotrain: error: --output {name!r}: name a file")
        assert not work.exists()  # refused before any run
    write = "echo 1 > {out}/result.txt"  # control: a relative path the runs write
    done = run_cli("verify", "--output", "result.txt", "--", "sh", "-c", write, cwd=tmp_path)
    assert (
        done.returncode == 0 and done.stdout == "reprotrain verify: IDENTICAL: 2 runs, result.txt\n"
    )


def test_a_link_out_of_the_run_folder_is_not_that_runs_output(tmp_path: Path) -> None:
    # each run writes its pid outside its folder and links to it: the same file, last pid
    outside = f"echo $$ > {tmp_path}/s.txt; ln -s {tmp_path}/s.txt {{out}}/result.txt"
    for index, named in enumerate(((), ("--output", "result.txt"))):
        work = tmp_path / f"runs-{index}"
        done = run_cli("verify", "--workdir", work, *named, "--", "sh", "-c", outside, cwd=tmp_path)
        assert done.returncode == 2 and "IDENTICAL" not in done.stdout, done.stdout
        (error,) = _error_lines(done)
        assert f"run-0/result.txt: a link to {tmp_path.resolve()}/s.txt, outside run 0's" in error
        assert not work.exists()  # no verdict: what this verify made is gone, a retry can run
    inside = "echo 1 > {out}/a.txt; ln -s a.txt {out}/result.txt"  # control: a link inside
    done = run_cli("verify", "--", "sh", "-c", inside, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "reprotrain verify: IDENTICAL: 2 runs, a.txt, result.txt\n"


def test_a_workdir_that_is_a_file_is_refused_and_missing_folders_are_made(tmp_path: Path) -> None:
    file = tmp_path / "FILE"
    file.write_text("not a folder\n")
    for workdir, said in ((file, "is a file"), (file / "sub", "cannot make it")):
        done = run_cli("verify", "--workdir", workdir, "--", "true", cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith(f"reprotrain: error: --workdir {workdir}: {said}")
        assert done.stderr.count("\n") == 1
    work = tmp_path / "a" / "missing" / "dir"  # control: a new folder, parents and all
    done = run_cli("verify", "--workdir", work, "--", "sh", "-c", "echo 1 > {out}/x", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (work / "run-1" / "x").read_text() == "1\n"


def test_threads_below_one_are_refused_when_the_arguments_are_read(tmp_path: Path) -> None:
    for verb in ("run", "verify"):
        for threads in ("0", "-1", "x"):
            argv = (verb, "--cpu-profile", "portable", "--threads", threads, "--", "true")
            done = run_cli(*argv, cwd=tmp_path)
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            assert done.stderr.startswith(
                f"reprotrain: error: argument --threads: {threads!r}: give a whole number >= 1"
            )
            assert done.stderr.count("\n") == 1
    done = run_cli("run", "--cpu-profile", "portable", "--threads", "1", "--", "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr  # control


def test_an_empty_command_is_named_as_empty(tmp_path: Path) -> None:
    for verb in ("run", "verify"):
        done = run_cli(verb, "--", "", cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr == (
            f"reprotrain: error: the command after `--` is empty (''); name the program to "
            f"{verb} first: reprotrain {verb} -- python train.py\n"
        )
    assert run_cli("run", "--", "true", cwd=tmp_path).returncode == 0  # control


def test_run_passes_out_on_as_written_and_only_verify_says_it_replaces_it(
    tmp_path: Path,
) -> None:
    done = run_cli("run", "--", "sh", "-c", 'echo {out} "${REPROTRAIN_OUT-unset}"', cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == "{out} unset\n", done.stdout + done.stderr
    assert "{out}" not in run_cli("run", "--help", cwd=tmp_path).stdout
    verify_help = " ".join(run_cli("verify", "--help", cwd=tmp_path).stdout.split())
    assert "{out} in it becomes the run's own folder" in verify_help


def test_a_run_that_failed_having_written_nothing_leaves_nothing_to_block_a_retry(
    tmp_path: Path,
) -> None:
    work = tmp_path / "runs"
    work.mkdir()
    (work / "notes.txt").write_text("mine\n")  # there before: never touched
    failed = run_cli("verify", "--workdir", work, "--", "nosuchcmd", cwd=tmp_path)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    (error,) = _error_lines(failed)
    assert error == (
        "reprotrain: error: nosuchcmd: No such file or directory; check the command after `--`"
    )
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    new = tmp_path / "new" / "dir"  # folders the failed verify made are gone too
    gone = run_cli("verify", "--workdir", new, "--", "sh", "-c", "exit 3", cwd=tmp_path)
    assert gone.returncode == 2 and _error_lines(gone)[0].endswith("exited 3 and printed nothing")
    assert not (tmp_path / "new").exists()
    write = ("--", "sh", "-c", "echo 1 > {out}/a.txt")
    retry = run_cli("verify", "--workdir", work, *write, cwd=tmp_path)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert (work / "notes.txt").read_text() == "mine\n"


def test_a_failed_run_that_printed_is_kept_and_the_retry_says_what_to_delete(
    tmp_path: Path,
) -> None:
    work = tmp_path / "runs"
    failed = run_cli("verify", "--workdir", work, "--", "sh", "-c", "echo oops; exit 3",
                     cwd=tmp_path)  # fmt: skip
    assert failed.returncode == 2, failed.stderr
    (error,) = _error_lines(failed)
    assert error.endswith(f"exited 3 (oops); see {work}/run-0.log")
    assert (work / "run-0.log").read_text() == "oops\n"  # what the line points to
    write = ("--", "sh", "-c", "echo 1 > {out}/a.txt")
    again = run_cli("verify", "--workdir", work, *write, cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert "run-0 is already there from an earlier verify (and run-0.log); " in again.stderr
    rm = again.stderr.split("delete them (`")[1].split("`)")[0]
    assert rm == f"rm -r {work}/run-0 {work}/run-0.log"
    subprocess.run(shlex.split(rm), check=True)  # as told
    retry = run_cli("verify", "--workdir", work, *write, cwd=tmp_path)
    assert retry.returncode == 0, retry.stdout + retry.stderr


def test_a_failed_verify_leaves_no_temporary_folder_unless_its_line_names_it(
    tmp_path: Path,
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    for cmd in (["nosuchcmd"], ["sh", "-c", "exit 3"], ["sh", "-c", "echo hi"]):
        done = run_cli("verify", "--", *cmd, cwd=tmp_path, TMPDIR=str(scratch))
        assert done.returncode == 2 and len(_error_lines(done)) == 1, done.stderr
        assert "see " not in done.stderr and list(scratch.iterdir()) == [], cmd
    printed = run_cli("verify", "--", "sh", "-c", "echo oops; exit 3", cwd=tmp_path,
                      TMPDIR=str(scratch))  # fmt: skip
    (kept,) = scratch.iterdir()  # control: the log of a run that printed, named in its line
    assert _error_lines(printed)[0].endswith(f"(oops); see {kept}/run-0.log")


def test_a_relative_workdir_gives_the_command_an_absolute_out(tmp_path: Path) -> None:
    write = 'cd / && echo 1 > "$REPROTRAIN_OUT/a.txt" && echo 2 > {out}/b.txt'
    done = run_cli("verify", "--workdir", "relw", "--", "sh", "-c", write, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "reprotrain verify: IDENTICAL: 2 runs, a.txt, b.txt"
    assert (tmp_path / "relw" / "run-1" / "a.txt").read_text() == "1\n"


def test_a_file_name_that_is_not_utf8_is_printed_escaped_with_its_verdict(
    tmp_path: Path,
) -> None:
    pid = 'echo $$ > "$REPROTRAIN_OUT/$(printf "a\\377b").txt"'
    env = {"PYTHONIOENCODING": "utf-8", "TMPDIR": str(tmp_path)}  # runs that differ are kept
    done = run_cli("verify", "--", "sh", "-c", pid, cwd=tmp_path, **env)
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.splitlines()[2].startswith("  a\\xffb.txt (file): differs (text, line 1: ")
    same = pid.replace("$$", "1")  # control: the same bytes in both runs
    json_ = run_cli("verify", "--json", "--", "sh", "-c", same, cwd=tmp_path, **env)
    assert json_.returncode == 0, json_.stderr
    assert json.loads(json_.stdout)["outputs"] == ["a\\xffb.txt"]


def test_a_negative_ops_step_and_threads_without_a_cpu_profile_are_refused(
    tmp_path: Path,
) -> None:
    work = tmp_path / "runs"
    for step in ("-1", "x"):
        done = run_cli("verify", "--workdir", work, "--ops-step", step, "--", "true", cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(
            f"reprotrain: error: argument --ops-step: {step!r}: give a step number >= 0"
        )
    for verb in ("run", "verify"):
        done = run_cli(verb, "--threads", "2", "--", "true", cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert done.stderr == (
            "reprotrain: error: --threads 2: needs --cpu-profile, the only thing that reads it; "
            "add --cpu-profile portable (or native), or drop --threads\n"
        )
    assert not work.exists()  # refused before any run
    alone = run_cli("verify", "--threads", "2", cwd=tmp_path)
    assert alone.returncode == 2 and "--threads: only with `-- CMD`" in alone.stderr
    write = ("--", "sh", "-c", "echo 1 > {out}/a.txt")
    control = run_cli("verify", "--ops-step", "0", "--cpu-profile", "native", "--threads", "2",
                      *write, cwd=tmp_path)  # fmt: skip
    assert control.returncode == 0, control.stderr


#: Weights that differ in every run (the pid); with ``FAIL_RECORDING`` its op-recording
#: rerun (``REPROTRAIN_RECORD_OPS`` set) exits 3.
RECORD_FAILS = """
import os, sys
import numpy as np
from safetensors.numpy import save_file
if os.environ.get("FAIL_RECORDING") and "REPROTRAIN_RECORD_OPS" in os.environ:
    print("cannot record here")
    raise SystemExit(3)
save_file({"w": np.full(2, float(os.getpid()))}, f"{sys.argv[1]}/model.safetensors")
"""


def test_an_ops_rerun_that_fails_leaves_the_verdict_and_says_why_the_op_is_not_named(
    tmp_path: Path,
) -> None:
    done = _verify(tmp_path, script=RECORD_FAILS, FAIL_RECORDING="1")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("reprotrain verify: NOT REPRODUCIBLE: ")
    (diagnosis,) = [line for line in lines if "op-level" in line]
    log = tmp_path / "runs" / "run-0-ops.log"
    assert diagnosis.startswith("  op-level diagnosis not made (step 0): ops rerun 0 of `")
    assert diagnosis.endswith(f"exited 3 (cannot record here); see {log}")
    assert log.read_text() == "cannot record here\n"
    control = _verify(tmp_path / "control", script=RECORD_FAILS)  # the reruns run
    assert control.returncode == 1, control.stdout + control.stderr
    assert "op-level" not in control.stdout and "  ops of step 0:" in control.stdout


#: Weights that differ in every run (the pid); a five-step trace whose loss differs from
#: step ``DIVERGE`` on in run 1; an ops rerun records the same ops in every process.
TRACED = """
import os, sys
import numpy as np
from safetensors.numpy import save_file
from reprotrain.hashing import safetensors_metadata
out, run = sys.argv[1], int(os.environ["REPROTRAIN_RUN_INDEX"])
save_file({"w": np.full(2, float(os.getpid()))}, f"{out}/model.safetensors")
steps = np.arange(5, dtype=np.int64)
loss = steps + run * (steps >= int(os.environ["DIVERGE"]))
columns = {name: steps.copy() for name in ("step", "batch_idx", "batch", "rng", "grads", "params")}
columns |= {"loss": loss, "loss_value": loss.astype(np.float64), "epoch": 0 * steps}
columns |= {"weights_traced": np.ones(5, bool), "initial_params": np.array([7])}
meta = {"format": "reprotrain.trace", "version": 2, "detail": "default", "weights_every": 1,
        "param_names": ["w"], "rng_sources": ["torch"]}
save_file(columns, f"{out}/trace.safetensors", safetensors_metadata(meta))
if "REPROTRAIN_RECORD_OPS" in os.environ:
    import torch
    from reprotrain.ops.recorder import record_step
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    for step in range(5):
        with record_step(model, step):
            model(torch.ones(1, 2)).sum().backward()
"""


def test_the_advice_when_the_recorded_ops_match_offers_only_what_was_not_done() -> None:
    tail = "; a race or unwritten memory may have agreed this time: "
    assert _when_ops_match(0, "default", None, None).endswith(
        f"{tail}run verify again, record another step (--ops-step N), or add TraceCallback so "
        "verify finds the step"
    )
    given = _when_ops_match(4, "--ops-step", None, None)
    assert given.endswith(f"{tail}run verify again, record another step than 4 (another "
                          "--ops-step), or add TraceCallback so verify finds the step")  # fmt: skip
    traced = _when_ops_match(4, "--ops-step", "read", None)
    assert traced == (
        "; the reruns matched at step 4 although the runs differed (the traces match, so they "
        f"name no step){tail}run verify again or record another step than 4 (another --ops-step)"
    )
    unreadable = _when_ops_match(0, "default", "unreadable", None)
    assert "(the trace could not be read, so it names no step)" in unreadable
    assert "TraceCallback" not in unreadable and "--ops-step N" in unreadable


def _ops_lines(done) -> list[str]:
    lines = done.stdout.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("  ops of step")) :]


def test_an_ops_step_given_wins_over_the_traces_step_and_the_advice_names_what_is_left(
    tmp_path: Path,
) -> None:
    given = _verify(tmp_path / "given", "--ops-step", "1", script=TRACED, DIVERGE="3")
    assert given.returncode == 1, given.stdout + given.stderr
    assert "traces diverge at step 3" in given.stdout
    head, ops = _ops_lines(given)[:2]
    assert head == "  ops of step 1 (--ops-step 1; the traces first differ at step 3):"
    (recorded,) = load_recordings(tmp_path / "given" / "runs" / "run-0-ops" / "ops").values()
    assert set(recorded.ops[:, 0].tolist()) == {1}  # the step given, not the trace's
    assert ops.endswith(
        "; the reruns matched at step 1 although the runs differed; a race or unwritten memory "
        "may have agreed this time: run verify again or record step 3, where the traces first "
        "differ (drop --ops-step)"
    )
    control = _verify(tmp_path / "control", script=TRACED, DIVERGE="3")  # the trace's step
    assert control.returncode == 1, control.stdout + control.stderr
    head, ops = _ops_lines(control)[:2]
    assert head == "  ops of step 3 (where the traces first differ):"
    assert ops.endswith("may have agreed this time: run verify again"), ops
    assert "TraceCallback" not in control.stdout and "--ops-step" not in control.stdout


def test_the_rm_it_suggests_clears_what_a_verify_with_more_runs_left(tmp_path: Path) -> None:
    work = tmp_path / "runs"
    write = ("--", "sh", "-c", "echo 1 > {out}/a.txt")
    first = run_cli("verify", "--runs", "3", "--workdir", work, *write, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    others = ("notes.txt", "run-x", "run-02", "run-2-ops")  # not verify's: never named
    for mine in others:
        (work / mine).write_text("mine\n")
    again = run_cli("verify", "--workdir", work, *write, cwd=tmp_path)  # 2 runs, the default
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    rm = again.stderr.split("delete them (`")[1].split("`)")[0]
    named = ("run-0", "run-0.log", "run-1", "run-1.log", "run-2", "run-2.log", "verified.json")
    assert rm == shlex.join(["rm", "-r", *(str(work / name) for name in named)])
    subprocess.run(shlex.split(rm), check=True)  # as told
    retry = run_cli("verify", "--workdir", work, *write, cwd=tmp_path)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert not (work / "run-2").exists()  # no run of the earlier verify left beside these
    assert all((work / mine).read_text() == "mine\n" for mine in others)


def test_an_output_named_twice_is_compared_and_printed_once(tmp_path: Path) -> None:
    write = ("--", "sh", "-c", "echo 1 > {out}/a.txt; echo 2 > {out}/b.txt")
    named = ("--output", "b.txt", "--output", "a.txt", "--output", "b.txt", "--output", "./b.txt")
    done = run_cli("verify", *named, *write, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "reprotrain verify: IDENTICAL: 2 runs, b.txt, a.txt\n"
    json_ = run_cli("verify", "--json", *named, *write, cwd=tmp_path)
    assert [f["name"] for f in json.loads(json_.stdout)["files"]] == ["b.txt", "a.txt"]
    other = run_cli("verify", "--output", "c.txt", "--output", "c.txt", *write, cwd=tmp_path)
    assert other.returncode == 2, other.stderr  # control: a file no run wrote is still refused
    assert _error_lines(other)[0].endswith(
        "run-0/c.txt: the command did not write c.txt; fix --output"
    )


#: Writes ``ckpts/a.txt`` and ``ckpts/deeper/b.txt`` (with ``PID`` set, the pid in b), a file
#: beside the folder, and with ``ONE_SIDED`` a file in the folder only run 1 writes.
FOLDER = """
mkdir -p {out}/ckpts/deeper {out}/empty
echo 1 > {out}/ckpts/a.txt
echo ${PID:+$$} > {out}/ckpts/deeper/b.txt
echo $$ > {out}/beside.txt
if [ -n "$ONE_SIDED" ] && [ "$REPROTRAIN_RUN_INDEX" = 1 ]; then echo 1 > {out}/ckpts/c.txt; fi
"""


def test_an_output_that_names_a_folder_compares_every_file_under_it(tmp_path: Path) -> None:
    cmd = ("--", "sh", "-c", FOLDER)
    tmp = {"TMPDIR": str(tmp_path)}  # runs that differ are kept
    done = run_cli("verify", "--output", "ckpts", *cmd, cwd=tmp_path, **tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "reprotrain verify: IDENTICAL: 2 runs, ckpts/a.txt, ckpts/deeper/b.txt\n"
    differs = run_cli("verify", "--output", "ckpts/", *cmd, cwd=tmp_path, PID="1", **tmp)
    assert differs.returncode == 4, differs.stdout + differs.stderr
    assert "\n  ckpts/deeper/b.txt (file): differs (text, line 1: " in differs.stdout
    assert "beside.txt (file)" not in differs.stdout  # beside the folder: not named
    one = run_cli("verify", "--output", "ckpts", *cmd, cwd=tmp_path, ONE_SIDED="1", **tmp)
    assert one.returncode == 4, one.stdout + one.stderr  # a verdict, as without --output
    assert "  ckpts/c.txt (file): differs (not written by run 0)" in one.stdout.splitlines()
    empty = run_cli("verify", "--output", "empty", *cmd, cwd=tmp_path, **tmp)
    assert empty.returncode == 2 and len(_error_lines(empty)) == 1, empty.stderr
    assert _error_lines(empty)[0] == (
        "reprotrain: error: --output empty: a folder with no file in it in any run, so nothing "
        "was compared; name a folder the command writes files in, or the files themselves"
    )


def test_verify_json_with_no_verdict_prints_the_error_as_json(tmp_path: Path) -> None:
    done = run_cli("verify", "--json", "--", "false", cwd=tmp_path)
    assert done.returncode == 2
    report = json.loads(done.stdout)
    assert report == {"error": "run 0 of `false` exited 1 and printed nothing", "exit_code": 2}
    assert done.stderr.strip().splitlines()[-1] == f"reprotrain: error: {report['error']}"
    # Control: without --json the error is the stderr line alone.
    assert run_cli("verify", "--", "false", cwd=tmp_path).stdout == ""
