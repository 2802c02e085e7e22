"""Guards for hand-kept links: layering, dvc.yaml vs the stage modules, the lock file."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
from pathlib import Path

import pathspec
import pytest
import yaml

from reprotrain.cli import VERBS
from reprotrain.commands import _exit_codes
from reprotrain.pipeline.command import STAGES as COMMAND_STAGES
from reprotrain.pipeline.command import Command, stage_arguments, stage_command
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.identity import source_files
from tests.helpers import ROOT, run_in_process

SRC = ROOT / "src"
PACKAGE = SRC / "reprotrain"
STAGES = ("prepare", "train", "evaluate")
#: Layer -> the layers it may import from (itself included). cli is on top.
MAY_IMPORT = {
    "library": {"library"},
    "pipeline": {"library", "pipeline"},
    "stages": {"library", "pipeline"},
    # Built-in recipes use the pipeline as any user's module does; nothing imports them
    # (params names them by class_path).
    "recipes": {"library", "pipeline", "recipes"},
    "commands": {"library", "pipeline", "stages", "commands"},
    "cli": {"library", "pipeline", "stages", "commands", "cli"},
}


def layer_of(module: str) -> str:
    """The layer of a ``reprotrain`` module, from its place in the folder tree."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in ("cli", "__main__"):
        return "cli"
    if parts[0] in ("commands", "recipes"):
        return parts[0]
    if parts[0] == "pipeline":
        return "stages" if parts[1:2] == ["stages"] else "pipeline"
    return "library"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layering_violations(package: Path) -> list[str]:
    """Every ``import`` (top level or inside a function) that points down the layers."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != package.name or target == package.name:
                    continue
                if layer_of(target) not in MAY_IMPORT[layer_of(module)]:
                    found.append(f"{module} ({layer_of(module)}) imports {target}")
    return found


def test_imports_run_only_from_the_cli_down_to_the_library() -> None:
    assert layering_violations(PACKAGE) == []


def test_a_planted_reverse_import_is_found(tmp_path: Path) -> None:
    copy = tmp_path / "reprotrain"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "trace" / "callback.py").open("a") as f:
        f.write("\n\ndef _planted() -> None:\n    from reprotrain.pipeline.config import Params\n")
    (copy / "pipeline" / "model.py").write_text("import reprotrain.pipeline.stages.train\n")
    assert layering_violations(copy) == [
        "reprotrain.pipeline.model (pipeline) imports reprotrain.pipeline.stages.train",
        "reprotrain.trace.callback (library) imports reprotrain.pipeline.config",
    ]


def imported_modules(path: Path, package: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, at module level or inside a function.

    ``from reprotrain.cpu import kernels`` names the module ``reprotrain.cpu.kernels``;
    ``from reprotrain.cpu.profile import CpuProfile`` names ``reprotrain.cpu.profile``.
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] == package.name and t in modules)
    return found


def import_cycles(package: Path) -> list[list[str]]:
    """Every set of the package's modules that import each other round a circle, sorted.

    Tarjan's strongly connected components over the import graph; a component of two
    or more modules, or a module that imports itself, is a cycle.
    """
    paths = {
        _module_name(p, package): p for p in package.rglob("*.py") if "__pycache__" not in p.parts
    }
    graph = {name: imported_modules(p, package, set(paths)) for name, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph[name]):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while not component or component[-1] != name:
                component.append(stack.pop())
            if len(component) > 1 or name in graph[name]:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(cycles)


def test_no_modules_import_each_other_round_a_circle() -> None:
    assert import_cycles(PACKAGE) == []


def test_a_planted_import_circle_is_found(tmp_path: Path) -> None:
    """Negative control: a tiny package whose modules import each other, one inside a function."""
    package = tmp_path / "reprotrain"
    (package / "cpu").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cpu" / "__init__.py").write_text("")
    (package / "cpu" / "profile.py").write_text(
        "def apply() -> None:\n    from reprotrain.cpu import kernels\n"
    )
    (package / "cpu" / "kernels.py").write_text("from reprotrain.cpu.gemm import mm\n")
    (package / "cpu" / "gemm.py").write_text("from reprotrain.cpu.profile import ROW_BLOCK\n")
    (package / "hashing.py").write_text("import reprotrain.hashing\n")
    (package / "atomic.py").write_text("from reprotrain.cpu import profile\n")
    assert import_cycles(package) == [
        ["reprotrain.cpu.gemm", "reprotrain.cpu.kernels", "reprotrain.cpu.profile"],
        ["reprotrain.hashing"],
    ]
    (package / "cpu" / "gemm.py").write_text("ROW_BLOCK = 128\n")  # the circle broken
    assert import_cycles(package) == [["reprotrain.hashing"]]


#: The most lines a module of the package may have: one that reads in one sitting.
MAX_MODULE_LINES = 400


def long_modules(package: Path) -> dict[str, int]:
    """Every module over :data:`MAX_MODULE_LINES` lines -> its line count."""
    counts = {
        path.relative_to(package).as_posix(): len(path.read_text().splitlines())
        for path in sorted(package.rglob("*.py"))
        if "__pycache__" not in path.parts
    }
    return {name: count for name, count in counts.items() if count > MAX_MODULE_LINES}


def test_every_module_reads_in_one_sitting() -> None:
    assert long_modules(PACKAGE) == {}


def test_a_planted_long_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert long_modules(tmp_path) == {"trace/long.py": MAX_MODULE_LINES + 1}


def exit_code_definitions(package: Path) -> list[str]:
    """Every ``EXIT_... = <int>`` outside commands/_exit_codes.py, as ``module.NAME``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "_exit_codes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Assign | ast.AnnAssign):
                continue
            if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            module = _module_name(path, package)
            found += [f"{module}.{name}" for name in names if name.startswith("EXIT_")]
    return found


def test_every_exit_code_is_defined_once_with_one_meaning() -> None:
    assert exit_code_definitions(PACKAGE) == []
    codes = [value for name, value in vars(_exit_codes).items() if name.startswith("EXIT_")]
    assert len(codes) == len(set(codes)) == 8


def test_a_planted_second_exit_code_is_found(tmp_path: Path) -> None:
    planted = tmp_path / "reprotrain" / "commands" / "compare.py"
    planted.parent.mkdir(parents=True)
    original = (PACKAGE / "commands" / "compare.py").read_text()
    planted.write_text(f"{original}\nEXIT_DIFFERENT = 1\n")
    assert exit_code_definitions(tmp_path / "reprotrain") == [
        "reprotrain.commands.compare.EXIT_DIFFERENT"
    ]


def _near(name: str) -> str:
    return name.lower().replace("_", "").removesuffix("s")


def test_no_two_modules_share_a_name_or_a_near_name() -> None:
    names = [
        p.stem
        for p in PACKAGE.rglob("*.py")
        if p.stem not in ("__init__", "__main__") and "__pycache__" not in p.parts
    ]
    seen: dict[str, str] = {}
    clashes = []
    for name in sorted(names):
        if _near(name.lstrip("_")) in seen:
            clashes.append((seen[_near(name.lstrip("_"))], name))
        seen[_near(name.lstrip("_"))] = name
    assert clashes == []


def test_stages_folder_is_exactly_the_dvc_yaml_stages_and_commands_are_the_other_verbs() -> None:
    stages = {p.stem for p in (PACKAGE / "pipeline" / "stages").glob("[!_]*.py")}
    assert stages == set(_dvc_stages()) == set(COMMAND_STAGES)
    verbs = {p.stem for p in (PACKAGE / "commands").glob("[!_]*.py")}
    for name, path in VERBS.items():
        layer = "stages" if name in stages else "commands"
        assert layer_of(path) == layer and path.endswith(f".{name.replace('-', '_')}"), name
        module = importlib.import_module(path)
        # Each verb module declares its own options and how the CLI runs it.
        assert isinstance(module.COMMAND, Command), name
        assert module.COMMAND.add_arguments is module.add_arguments, name
        assert module.COMMAND.takes_params == bool(module.PARAMS), name
        assert callable(module.run), name
    assert {n.replace("-", "_") for n in VERBS} == stages | verbs
    assert list(VERBS)[: len(COMMAND_STAGES)] == list(COMMAND_STAGES)


def _dvc_stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_yaml_params_are_exactly_what_the_stage_reads(stage: str) -> None:
    declared = tuple(_dvc_stages()[stage].get("params", ()))
    module = importlib.import_module(f"reprotrain.pipeline.stages.{stage}")
    assert declared == module.PARAMS


def _dvc_visible(path: Path, deps: list[str]) -> bool:
    """Inside one of ``deps`` and not hidden from DVC by .dvcignore."""
    ignore = pathspec.PathSpec.from_lines(
        "gitignore", (ROOT / ".dvcignore").read_text().splitlines()
    )
    relative = path.relative_to(ROOT).as_posix()
    inside = any(relative == dep or relative.startswith(f"{dep}/") for dep in deps)
    return inside and not ignore.match_file(relative)


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_sees_every_source_file_the_stage_runs(stage: str) -> None:
    spec = _dvc_stages()[stage]
    assert spec["cmd"].startswith(f"reprotrain {stage} ")
    # The run ID hashes exactly these files (run_record.run_inputs), so DVC must track them.
    files = source_files(f"reprotrain.pipeline.stages.{stage}")
    assert len(files) > 3
    hidden = [str(f.relative_to(ROOT)) for f in files if not _dvc_visible(f, spec["deps"])]
    assert hidden == [], f"dvc.yaml stage {stage!r} does not track {hidden}"


def test_a_command_module_is_hidden_from_dvc_so_a_stage_importing_it_is_caught() -> None:
    deps = _dvc_stages()["train"]["deps"]
    assert not _dvc_visible(PACKAGE / "commands" / "verify.py", deps)
    assert not _dvc_visible(PACKAGE / "cli.py", deps)
    assert _dvc_visible(PACKAGE / "pipeline" / "stages" / "train.py", deps)


def test_env_stage_runs_on_every_repro_and_feeds_train() -> None:
    stages = _dvc_stages()
    assert stages["env"]["always_changed"] is True
    env_out = next(iter(stages["env"]["outs"][0]))
    assert env_out in stages["train"]["deps"]


def test_cpu_lock_pins_every_package_with_a_hash_and_no_local_paths() -> None:
    text = (ROOT / "requirements-cpu.lock").read_text()
    pins = re.findall(
        r"^([A-Za-z0-9_.\-]+)==(\S+) \\\n((?:\s+--hash=sha256:[0-9a-f]{64}.*\n)+)", text, re.M
    )
    requirement_lines = [line for line in text.splitlines() if re.match(r"^[A-Za-z0-9]", line)]
    assert len(pins) == len(requirement_lines) > 50
    assert dict((n.lower(), v) for n, v, _ in pins)["torch"] == "2.13.0+cpu"
    for forbidden in ("file://", "/opt/", "--find-links", "--index-url", "--extra-index-url"):
        assert forbidden not in text


def test_requirements_in_direct_dependencies_are_in_the_lock() -> None:
    lock = (ROOT / "requirements-cpu.lock").read_text().lower()
    for line in (ROOT / "requirements.in").read_text().splitlines():
        name = re.split(r"[<>=!~\[ ]", line.strip(), maxsplit=1)[0].lower()
        if name and not name.startswith("#"):
            assert f"\n{name}==" in f"\n{lock}", name


def _pins(lock: str) -> dict[str, str]:
    text = (ROOT / lock).read_text()
    return {n.lower(): v for n, v in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+) \\$", text, re.M)}


def test_container_lock_is_the_cuda_build_with_every_wheel_hashed() -> None:
    text = (ROOT / "requirements.lock").read_text()
    pins = _pins("requirements.lock")
    assert pins["torch"] == "2.13.0"
    assert {"triton", "nvidia-cudnn-cu13", "nvidia-cublas", "nvidia-nccl-cu13"} <= set(pins)
    blocks = re.findall(
        r"^[A-Za-z0-9][^\n]*==[^\n]*\\\n((?:\s+--hash=sha256:[0-9a-f]{64}.*\n)+)", text, re.M
    )
    assert len(blocks) == len(pins)
    for forbidden in ("file://", "/opt/", "--find-links", "--index-url"):
        assert forbidden not in text


def test_the_two_locks_pin_the_same_versions_of_what_they_share() -> None:
    cpu, cuda = _pins("requirements-cpu.lock"), _pins("requirements.lock")
    shared = set(cpu) & set(cuda)
    assert len(shared) > 50
    differ = {n: (cpu[n], cuda[n]) for n in shared if cpu[n].split("+")[0] != cuda[n].split("+")[0]}
    assert not differ


def test_env_stage_leaves_the_lock_to_reprotrain_lock_and_every_lock_is_a_dep() -> None:
    # The container sets REPROTRAIN_LOCK=requirements.lock; a --lock in dvc.yaml would
    # override it and make `train` refuse the container's (CUDA) install as drift.
    stages = _dvc_stages()
    assert "--lock" not in stages["env"]["cmd"]
    for stage in STAGES:
        locks = {dep for dep in stages[stage]["deps"] if dep.endswith(".lock")}
        assert locks == {"requirements-cpu.lock", "requirements.lock"}, stage


def test_workflow_actions_are_pinned_by_sha_with_read_only_permissions() -> None:
    workflows = sorted((ROOT / ".github/workflows").glob("*.yml"))
    assert workflows
    for path in workflows:
        text = path.read_text()
        uses = re.findall(r"^\s*(?:-\s*)?uses:\s*(\S+)", text, re.M)
        assert uses, path
        for action in uses:
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", action), f"{path}: {action}"
        spec = yaml.safe_load(text)
        assert spec["permissions"] == {"contents": "read"}, path
        for name, job in spec["jobs"].items():
            assert "write" not in str(job.get("permissions", "")), f"{path}: job {name}"


@pytest.mark.parametrize("stage", COMMAND_STAGES)
def test_every_stage_command_in_dvc_yaml_parses_with_its_own_parser(stage: str) -> None:
    args = stage_arguments(stage, ROOT / "dvc.yaml")
    paths = {k: v for k, v in vars(args).items() if v is not None and not isinstance(v, bool)}
    values = [
        v for value in paths.values() for v in (value if isinstance(value, list) else [value])
    ]
    assert paths and all(isinstance(value, Path) for value in values), paths


def test_a_stage_command_with_an_unknown_option_is_one_data_error(tmp_path: Path) -> None:
    dvc_yaml = tmp_path / "dvc.yaml"
    dvc_yaml.write_text(
        "stages:\n  prepare:\n    cmd: reprotrain prepare --raw-dir r --out x --outt y\n"
    )
    with pytest.raises(DataError, match=r"stage 'prepare': .*--outt.*fix its cmd"):
        stage_arguments("prepare", dvc_yaml)


def _pipeline(cmd: str) -> str:
    """A dvc.yaml whose every stage runs ``cmd`` (``{stage}`` filled in)."""
    stages = "".join(f"  {s}:\n    cmd: {cmd.format(stage=s)}\n" for s in COMMAND_STAGES)
    return f"stages:\n{stages}"


#: A dvc.yaml that cannot be read (None: a folder in its place) -> what its error line says.
BAD_DVC_YAML = {
    "bad YAML": ("stages: [\n", r"not valid YAML \(line 2\): fix the syntax"),
    "a folder": (None, r"is a folder; pass the pipeline file"),
    "an unclosed quote": (
        _pipeline("reprotrain {stage} --out 'x"),
        r"stage '\w+': cmd cannot be split as a shell would \(No closing quotation\); fix",
    ),
    "a cmd that is a mapping": (
        _pipeline("{{run: reprotrain {stage}}}"),
        r"stage '\w+': cmd must be a command line or a list of them; fix its cmd",
    ),
}


@pytest.mark.parametrize(
    ("verb", "case"),
    [
        (verb, case)
        for verb in ("status", "checklist", "verify", "compare")
        for case in BAD_DVC_YAML
        # compare DIR reads DIR/dvc.yaml only when it is a file (else DIR is a run folder)
        if (verb, case) != ("compare", "a folder")
    ],
)
def test_a_bad_dvc_yaml_is_one_line_naming_it_with_exit_2(
    tmp_path: Path, verb: str, case: str
) -> None:
    text, expect = BAD_DVC_YAML[case]
    dvc_yaml = tmp_path / "dvc.yaml"
    if text is None:
        dvc_yaml.mkdir()
    else:
        dvc_yaml.write_text(text, encoding="utf-8")
    argv = [tmp_path, tmp_path] if verb == "compare" else ["--dvc-yaml", dvc_yaml]
    result = run_in_process(verb, *argv)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert re.fullmatch(rf"reprotrain: error: {re.escape(str(dvc_yaml))}: {expect}.*", line)


def test_a_cmd_list_runs_the_stage_command_in_it(tmp_path: Path) -> None:
    """DVC runs a list ``cmd`` in order; the stage's own command is the one entry that is it."""
    written = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["cmd"]
    dvc_yaml = tmp_path / "dvc.yaml"
    listed = {"stages": {"train": {"cmd": ["echo start", written, "echo done"]}}}
    dvc_yaml.write_text(yaml.safe_dump(listed), encoding="utf-8")
    assert stage_command("train", dvc_yaml) == stage_command("train", ROOT / "dvc.yaml")
    assert stage_arguments("train", dvc_yaml) == stage_arguments("train", ROOT / "dvc.yaml")
    # Through the CLI, compare gets past dvc.yaml to the model it names.
    result = run_in_process("compare", tmp_path, tmp_path)
    assert result.returncode == 2
    assert f"{tmp_path / 'models/model.safetensors'}: no trained model" in result.stderr
    # Negative controls: a list with no such command, or with two, is refused in one line.
    for cmd, expect in (
        (["echo start"], "cmd does not run `reprotrain train`; fix its cmd"),
        ([written, written], "cmd runs `reprotrain train` 2 times; keep one"),
    ):
        listed["stages"]["train"]["cmd"] = cmd
        dvc_yaml.write_text(yaml.safe_dump(listed), encoding="utf-8")
        with pytest.raises(DataError, match=re.escape(f"{dvc_yaml}: stage 'train': {expect}")):
            stage_command("train", dvc_yaml)
