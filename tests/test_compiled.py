"""``torch.compile`` under the guarantees: what the record holds, and compiled bits.

Quick: where code compiles is found without importing it, the environment record
holds the C++ compiler, ``-march`` and vector level only for a recipe that compiles,
and a missing compiler is one line at the env stage, before any output. Slow (Inductor
builds C++): a compiled loop under ``verify -- CMD`` is IDENTICAL with a cold and then
a warm Inductor cache, a compiler that calls itself another version gives the same
bits, the portable profile's compiled bits do not follow ``-march``, and the vector
level does decide them (the negative control: why the profile pins it); the compiled
LM recipe (pipelines/lm-compiled) verifies IDENTICAL compiled, uncompiled and under DDP
at 2 processes, and a SIGTERM'd compiled run resumes to the uninterrupted one's bits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from reprotrain.pipeline.config import Component, Params
from reprotrain.pipeline.params_file import load_params
from reprotrain.pipeline.recipe_code import compiling_code
from reprotrain.provenance.toolchain import (
    calls_compile,
    compile_record,
    inductor_variables,
    missing_compiler,
)
from tests.helpers import ROOT, run_cli, run_process, signal_after_checkpoint

LM_COMPILED = ROOT / "pipelines/lm-compiled/params.yaml"
LOOP = ROOT / "tests/scripts/compiled_loop.py"


def test_compile_calls_are_found_and_re_compile_is_not(tmp_path: Path) -> None:
    code = tmp_path / "model.py"
    code.write_text(
        "import re, torch\n"
        "PATTERN = re.compile('a+')\n"
        "net = torch.compile(object())\n"
        "class M:\n"
        "    def configure_model(self):\n"
        "        self.layer.compile()\n"
    )
    assert calls_compile([code]) == [f"{code}:3", f"{code}:6"]
    (tmp_path / "plain.py").write_text("import re\nre.compile('x')\ncompile('1', 'f', 'eval')\n")
    assert calls_compile([tmp_path / "plain.py"]) == []


def test_the_shipped_recipes_compile_only_where_params_say_so() -> None:
    params = load_params(LM_COMPILED)
    assert compiling_code(params)  # TinyGPT.configure_model calls block.compile()
    off = {**params.model.init_args, "compile": False}  # pipelines/lm: compile: false
    assert compiling_code(Params(model=Component(params.model.class_path, off))) == []
    assert compiling_code(Params()) == []  # the digits recipe


def test_a_users_package_that_compiles_is_found_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (package / "model.py").write_text("class Net:\n    pass\n")
    (package / "helpers.py").write_text(
        "import torch\n\ndef fast(m):\n    return torch.compile(m)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = Component("userpkg.model.Net")
    assert compiling_code(Params(model=model, data=None), tmp_path) == [
        f"{package / 'helpers.py'}:4"
    ]
    (package / "helpers.py").write_text("def fast(m):\n    return m\n")
    assert compiling_code(Params(model=model, data=None), tmp_path) == []  # the control
    (tmp_path / "extra.py").write_text("def go(m):\n    m.compile()\n")
    listed = Component("userpkg.model.Net", code=("extra.py",))
    assert compiling_code(Params(model=listed, data=None), tmp_path) == [
        f"{tmp_path / 'extra.py'}:2"
    ]


def test_inductor_variables_leave_out_places_and_logging() -> None:
    environ = {
        "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/somewhere",
        "TORCHINDUCTOR_FREEZING": "1",
        "PATH": "/bin",
    }
    assert inductor_variables(environ) == {
        "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3",
        "TORCHINDUCTOR_FREEZING": "1",
    }
    record = compile_record({**environ, "CXX": "/nonexistent/c++"})
    assert record["cxx"] == "missing: /nonexistent/c++" and record["march"] == "x86-64-v3"
    assert compile_record({})["march"] == "native"  # Inductor's default, the host's ISA


def test_a_missing_compiler_is_named_with_its_package() -> None:
    line = missing_compiler({"CXX": "/nonexistent/c++"})
    assert line is not None and "CXX=/nonexistent/c++" in line and "apt-get install g++" in line
    assert missing_compiler({"PATH": os.environ["PATH"]}) is None  # g++ is here (.ci/run)


def _fake_torch(folder: Path, version: str) -> Path:
    """A folder whose ``torch`` package is only a ``version.py``: another torch build."""
    (folder / "torch").mkdir(parents=True, exist_ok=True)
    (folder / "torch" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (folder / "torch" / "version.py").write_text(f"__version__ = {version!r}\n")
    return folder


def _cache_dir_of(env: dict[str, str], cwd: Path) -> str:
    code = "from reprotrain.provenance.toolchain import keyed_cache_dir; print(keyed_cache_dir())"
    done = run_process([sys.executable, "-c", code], cwd, env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_inductors_cache_has_a_folder_per_torch_build_and_compiler(tmp_path: Path) -> None:
    """Inductor keys a kernel by its source and command alone: another torch at the same
    path, or a compiler upgraded in place, would load kernels built before (the
    measurement: benchmarks/cpu/inductor_cache_reuse.py). So reprotrain keys a folder."""
    compiler = tmp_path / "bin" / "c++"
    compiler.parent.mkdir()
    compiler.write_text('#!/bin/sh\necho "c++ (test) 12.0"\n')
    compiler.chmod(0o755)
    src = str(ROOT / "src")
    base = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(compiler)}

    def folder(torch_version: str) -> str:
        site = _fake_torch(tmp_path / torch_version, torch_version) if torch_version else None
        path = os.pathsep.join([*([str(site)] if site else []), src])
        return _cache_dir_of({**base, "PYTHONPATH": path}, tmp_path)

    first = folder("2.13.0+cpu")
    assert Path(first).parent == tmp_path / "cache"  # inside the user's folder
    assert folder("2.13.0+cpu") != folder("2.14.1+cpu")
    compiler.write_text('#!/bin/sh\necho "c++ (test) 13.0"\n')  # upgraded in place
    assert folder("2.13.0+cpu") != first
    compiler.write_text('#!/bin/sh\necho "c++ (test) 12.0"\n')
    assert folder("2.13.0+cpu") == first  # the control: the same build, the same folder
    again = _cache_dir_of(
        {**base, "PYTHONPATH": src, "TORCHINDUCTOR_CACHE_DIR": folder("")}, tmp_path
    )
    assert again == folder("")  # a folder it named is not nested again
    # a user's folder that only starts like one is the user's
    mine = tmp_path / "reprotrain-cache"
    assert Path(_cache_dir_of({**base, "PYTHONPATH": src, "TORCHINDUCTOR_CACHE_DIR": str(mine)},
                              tmp_path)).parent == mine  # fmt: skip


def test_run_and_configure_determinism_point_inductor_at_the_keyed_folder(tmp_path: Path) -> None:
    code = (
        "import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR']);"
        "from reprotrain.determinism import configure_determinism; configure_determinism(0, True);"
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    )
    done = run_cli(
        "run", "--", sys.executable, "-c", code, cwd=tmp_path,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
    )  # fmt: skip
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    launched, configured = done.stdout.split()
    assert Path(launched).parent == tmp_path / "cache"
    assert Path(launched).name.startswith("reprotrain-") and configured == launched


def _env_record(tmp_path: Path, params: Path, **env: str):
    out = tmp_path / "environment.json"
    done = run_cli("env", "--params", params, "--out", out, cwd=ROOT, **env)
    return done, out


def test_a_compiling_recipes_record_holds_the_compiler_march_and_vector_level(
    tmp_path: Path,
) -> None:
    done, out = _env_record(tmp_path, LM_COMPILED)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["compile"]["march"] == "x86-64-v3"  # portable's pin, not -march=native
    assert record["compile"]["vector_isa"] == "avx2"
    assert record["compile"]["cxx"].startswith("g++")
    # negative control: the uncompiled LM's record has no compile section
    done, out = _env_record(tmp_path, ROOT / "pipelines/lm/params.yaml")
    assert done.returncode == 0, done.stderr
    assert "compile" not in json.loads(out.read_text())


def test_a_missing_compiler_is_one_line_at_the_env_stage_and_nothing_written(
    tmp_path: Path,
) -> None:
    done, out = _env_record(tmp_path, LM_COMPILED, CXX="/nonexistent/c++")
    assert done.returncode != 0 and not out.exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "apt-get install g++" in lines[0], done.stderr
    assert "language_model.py:" in lines[0]  # where the model compiles
    # the uncompiled LM needs no compiler
    done, out = _env_record(tmp_path, ROOT / "pipelines/lm/params.yaml", CXX="/nonexistent/c++")
    assert done.returncode == 0 and out.exists(), done.stderr


def _loop(tmp_path: Path, name: str, *args: str, profile: str | None = "portable", **env: str):
    """The compiled loop in a fresh process; the sha256 of the weights it wrote."""
    out = tmp_path / name
    launch = ["run", "--cpu-profile", profile, "--"] if profile else []
    command = [sys.executable, "-m", "reprotrain", *launch] if launch else []
    done = run_process(
        [*command, sys.executable, str(LOOP), str(out), *args],
        ROOT,
        {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"), **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled graphs: " in done.stdout and "compiled graphs: 0" not in done.stdout
    return (out / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_verify_is_identical_compiled_with_a_cold_then_a_warm_cache(tmp_path: Path) -> None:
    cache = tmp_path / "inductor-cache"
    done = run_cli(
        "verify",
        "--cpu-profile",
        "portable",
        "--workdir",
        tmp_path / "runs",
        "--",
        sys.executable,
        LOOP,
        "{out}",
        cwd=ROOT,
        TORCHINDUCTOR_CACHE_DIR=str(cache),
    )
    assert done.returncode == 0 and "IDENTICAL" in done.stdout, done.stdout + done.stderr
    assert any(cache.rglob("*.so"))  # the second run found the first's compiled code


@pytest.mark.slow
def test_compiled_bits_follow_neither_the_compilers_version_nor_march(tmp_path: Path) -> None:
    """One rebuild with both changed (each is a cold build: two would double the test's
    time); the vector level, which does decide the bits, is the next test's control. The
    compiler is upgraded in place (one path, another version): Inductor's own key would
    not see it, the keyed cache folder does, so the second run builds anew."""
    wrapper = tmp_path / "bin" / "c++"
    wrapper.parent.mkdir()
    gxx = shutil.which("g++")

    def compiler(version: str) -> str:
        wrapper.write_text(
            f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "c++ (test) {version}"; exit 0; }}\n'
            f'exec {gxx} "$@"\n'
        )
        wrapper.chmod(0o755)
        return str(wrapper)

    cold = _loop(tmp_path, "cold", CXX=compiler("12.0"))
    assert _loop(tmp_path, "other-compiler-march-native", "native", CXX=compiler("99.0")) == cold
    built = [d for d in (tmp_path / "inductor-cache").iterdir() if any(d.rglob("*.so"))]
    assert len(built) == 2, built  # one folder per compiler version, each built


@pytest.mark.slow
def test_the_vector_level_decides_compiled_bits() -> None:
    """Negative control: plain torch at ATen's default (no vectors) and at AVX2 differ, so
    the portable profile pins the level Inductor writes for."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        scalar = _loop(tmp, "default", profile=None, ATEN_CPU_CAPABILITY="default")
        vector = _loop(tmp, "avx2", profile=None, ATEN_CPU_CAPABILITY="avx2")
    assert scalar != vector


def _lm_compiled_train(out: Path, env: Path, *overrides: str) -> list[str]:
    """`reprotrain train` of pipelines/lm-compiled into a flat run folder ``out``."""
    return [
        "train",
        *("--params", str(LM_COMPILED), *overrides),
        *("--env", str(env), "--checkpoints", str(out / "ckpt")),
        *("--model", str(out / "model.safetensors"), "--trace", str(out / "trace.safetensors")),
        *("--metrics", str(out / "metrics.json"), "--plots", str(out / "plots")),
        *("--run-record", str(out / "run.json")),
    ]


@pytest.fixture(scope="module")
def compiled_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("env") / "environment.json"
    done = run_cli("env", "--params", LM_COMPILED, "--out", out, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [(), ("model.init_args.compile=false",), ("train.devices=2", "train.strategy=ddp")],
    ids=["compiled", "uncompiled", "compiled DDP at 2 processes"],
)
def test_verify_trains_the_compiled_recipe_to_identical_bits(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    sets = [arg for item in overrides for arg in ("-S", item)]
    done = run_cli(
        "verify",
        "--dvc-yaml",
        "pipelines/lm-compiled/dvc.yaml",
        "--workdir",
        tmp_path,
        *sets,
        cwd=ROOT,
    )
    assert done.returncode == 0 and "IDENTICAL" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_a_compiled_run_stopped_by_sigterm_resumes_to_the_same_bits(
    compiled_env: Path, tmp_path: Path
) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    two_epochs = ("-S", "train.max_epochs=2")  # the recipe trains one: stop after the first
    done = run_cli(*_lm_compiled_train(straight, compiled_env, *two_epochs), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    argv = _lm_compiled_train(stopped, compiled_env, *two_epochs)
    stopped.mkdir()
    code, stderr = signal_after_checkpoint(argv, stopped, signal.SIGTERM)
    assert code == 130 and "training interrupted" in stderr, stderr
    assert not (stopped / "model.safetensors").exists()
    done = run_cli(*argv, cwd=ROOT)
    assert done.returncode == 0 and "resumed from epoch=" in done.stdout, done.stderr
    for name in ("model.safetensors", "trace.safetensors", "metrics.json"):
        assert (stopped / name).read_bytes() == (straight / name).read_bytes(), name
