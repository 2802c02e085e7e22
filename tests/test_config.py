"""params.yaml -> frozen config: the shipped file loads, every bad value names its key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from reprotrain.pipeline.config import ConfigError, Params
from reprotrain.pipeline.params_file import load_params, parse_params, render_defaults
from tests.helpers import DELETE, ROOT, params_with, run_cli, run_in_process


def _defaults() -> dict:
    return yaml.safe_load(render_defaults())


def test_shipped_params_yaml_loads_into_frozen_config(repo_root: Path) -> None:
    params = load_params(repo_root / "params.yaml")
    assert isinstance(params, Params)
    assert params.data.init_args["num_workers"] == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.seed = 1  # type: ignore[misc]


def test_shipped_params_yaml_holds_the_defaults(repo_root: Path) -> None:
    assert load_params(repo_root / "params.yaml") == Params()


def test_rendered_defaults_load_back_to_the_defaults() -> None:
    assert parse_params(_defaults()) == Params()


def _with(path: str, value: object) -> dict:
    return params_with({path: value})


_DELETE = DELETE


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("colour", "red", "unknown key 'colour'"),
        ("train.momentum", 0.9, "unknown key 'train.momentum'"),
        ("seed", _DELETE, "missing key 'seed'"),
        ("train.max_epochs", _DELETE, "missing key 'train.max_epochs'"),
        ("seed", "forty-two", "seed: got 'forty-two'; expected an integer"),
        ("seed", True, "seed: got True; expected an integer"),
        ("seed", 1.5, "seed: got 1.5; expected an integer"),
        ("seed", -1, "seed: got -1; expected an integer >= 0 and <= 4294967295"),
        ("seed", 2**32, "seed: got 4294967296"),
        ("model.colour", "red", "unknown key 'model.colour'"),
        ("model.class_path", 3, "model.class_path: expected a dotted path"),
        ("data.class_path", "Net", "data.class_path: expected a dotted path"),
        ("data.init_args", [1], "data.init_args: expected a mapping of argument names"),
        ("model.code", "src", "model.code: expected a list of files or folders"),
        ("deterministic", "maybe", "deterministic: got 'maybe'; expected one of true, false, warn"),
        ("deterministic", 1, "deterministic: got 1"),
        ("train.accelerator", "auto", "train.accelerator: got 'auto'; expected one of cpu, gpu"),
        ("train.precision", "8-bit", "train.precision: got '8-bit'"),
        ("train.precision", "16-mixed", "train.precision: 16-mixed with train.accelerator: cpu"),
        ("model", 3, "model: expected a mapping"),
        (
            "prepare.val_fraction",
            0.9,
            "prepare.val_fraction + prepare.test_fraction must be below 1",
        ),
    ],
)
def test_bad_value_names_the_key(key: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_params(_with(key, value), source="params.yaml")
    message = str(caught.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("model.init_args.lr", 0, "model.init_args.lr: Not of type PositiveFloat: 0 does not"),
        ("model.init_args.lr", "fast", "model.init_args.lr: Not of type PositiveFloat"),
        ("data.init_args.num_workers", -1, "data.init_args.num_workers: Not of type NonNeg"),
        ("model.init_args.hiddn", 3, "model.init_args.hiddn: no such argument of reprotrain"),
        ("model.init_args.optimizer", "rmsprop", "model.init_args.optimizer: Expected a typing"),
        ("model.init_args.num_classes", 3, "model.init_args.num_classes: set from the data"),
        ("model.class_path", "mypkg.Net", "model.class_path: cannot import 'mypkg.Net'"),
        ("model.class_path", "reprotrain.recipes.digits.DigitsData", "is not a LightningModule"),
    ],
)
def test_bad_init_arg_or_class_names_the_key(key: str, value: object, expected: str) -> None:
    from reprotrain.pipeline.recipe import resolve_recipe

    params = parse_params(_with(key, value), source="params.yaml")
    with pytest.raises(ConfigError) as caught:
        resolve_recipe(params)
    message = str(caught.value)
    assert expected in message
    assert "\n" not in message


def test_float_arguments_accept_integers_and_yaml_strings() -> None:
    from reprotrain.pipeline.recipe import resolve_recipe

    assert resolve_recipe(parse_params(_with("model.init_args.lr", 1))).model.init_args["lr"] == 1.0
    resolved = resolve_recipe(parse_params(_with("model.init_args.lr", "1e-3")))
    assert resolved.model.init_args["lr"] == 0.001  # PyYAML reads 1e-3 as a string


def test_init_args_may_leave_out_arguments_with_defaults() -> None:
    from reprotrain.pipeline.recipe import resolve_recipe

    resolved = resolve_recipe(parse_params(_with("model.init_args.lr", _DELETE)))
    assert resolved.model.init_args["lr"] == 0.005  # the class's default, recorded


def test_overrides_apply_with_yaml_types(tmp_path: Path, repo_root: Path) -> None:
    params = load_params(
        repo_root / "params.yaml", ["seed=7", "model.init_args.lr=0.01", "deterministic=warn"]
    )
    assert (params.seed, params.model.init_args["lr"], params.deterministic) == (7, 0.01, "warn")


def test_an_override_may_add_an_init_arg(repo_root: Path) -> None:
    params = load_params(repo_root / "params.yaml", ["data.init_args.extra=1"])
    assert params.data.init_args["extra"] == 1


def _without_init_args(tmp_path: Path) -> Path:
    """params.yaml whose model section leaves init_args out (valid: every argument but the
    linked ones has a default)."""
    raw = _with("model.init_args", _DELETE)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_an_override_under_init_args_works_where_the_file_leaves_init_args_out(
    tmp_path: Path,
) -> None:
    from reprotrain.pipeline.recipe import resolve_recipe

    path = _without_init_args(tmp_path)
    assert resolve_recipe(load_params(path)).model.init_args["lr"] == 0.005  # control: default
    params = load_params(path, ["model.init_args.lr=1"])
    assert params.model.init_args == {"lr": 1}
    assert resolve_recipe(params).model.init_args["lr"] == 1.0


def test_an_unknown_argument_under_a_left_out_init_args_is_refused_by_the_class(
    tmp_path: Path,
) -> None:
    from reprotrain.pipeline.recipe import resolve_recipe

    params = load_params(_without_init_args(tmp_path), ["model.init_args.hiddn=3"])
    with pytest.raises(ConfigError, match=r"^model\.init_args\.hiddn: no such argument of "):
        resolve_recipe(params)
    with pytest.raises(ConfigError, match=r"unknown key 'model\.init_arg\.lr'"):
        load_params(_without_init_args(tmp_path), ["model.init_arg.lr=1"])  # not init_args


def test_a_null_override_is_kept_and_refused_where_the_type_allows_no_none(
    repo_root: Path,
) -> None:
    from reprotrain.pipeline.recipe import resolve_recipe

    params = load_params(repo_root / "params.yaml", ["model.init_args.hidden=null"])
    assert params.model.init_args["hidden"] is None  # null, not the default
    with pytest.raises(ConfigError, match=r"^model\.init_args\.hidden: got null, which "):
        resolve_recipe(params)
    resolve_recipe(load_params(repo_root / "params.yaml", ["model.init_args.hidden=32"]))


@pytest.mark.parametrize("item", ["train.momentum=1", "nokey", "data=3"])
def test_bad_override_is_refused(item: str, repo_root: Path) -> None:
    with pytest.raises(ConfigError):
        load_params(repo_root / "params.yaml", [item])


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text("seed: 42\ndata: [unclosed\n")
    with pytest.raises(ConfigError, match=r"params.yaml: not valid YAML \(line \d+\)"):
        load_params(path)


_CLI_BAD = {
    "malformed_yaml": ("seed: 42\ndata: [unclosed\n", "params.yaml: not valid YAML (line 3)"),
    "unknown_key": (yaml.safe_dump(_with("colour", "red")), "unknown key 'colour'"),
    "missing_key": (yaml.safe_dump(_with("seed", _DELETE)), "missing key 'seed'"),
    "wrong_type": (
        yaml.safe_dump(_with("model.init_args.lr", -0.5)),
        "model.init_args.lr: Not of type PositiveFloat: -0.5 does not conform",
    ),
}


@pytest.mark.parametrize("case", sorted(_CLI_BAD))
def test_cli_bad_params_exit_2_and_write_nothing(case: str, tmp_path: Path, prepared: Path) -> None:
    text, expected = _CLI_BAD[case]
    (tmp_path / "params.yaml").write_text(text)
    earlier = tmp_path / "model.safetensors"
    earlier.write_bytes(b"earlier output")
    result = run_in_process(
        "train",
        *("--params", tmp_path / "params.yaml"),
        *("--data", prepared, "--model", earlier, "--metrics", tmp_path / "metrics.json"),
        *("--plots", tmp_path / "plots", "--env", tmp_path / "env.json"),
        *("--run-record", tmp_path / "run.json", "--checkpoints", tmp_path / "ckpt"),
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reprotrain: error: ")
    assert expected in lines[0]
    assert earlier.read_bytes() == b"earlier output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "params.yaml"]


def test_cli_seed_override_reaches_params(repo_root: Path) -> None:
    result = run_cli("params", "--seed", "7", "-S", "train.max_epochs=3", cwd=repo_root)
    assert result.returncode == 0, result.stderr
    assert "seed=7" in result.stdout
    assert "max_epochs=3" in result.stdout


def test_16_mixed_stays_allowed_on_a_gpu_and_bf16_mixed_on_the_cpu() -> None:
    """The control of the 16-mixed refusal: only the pair Lightning silently changes."""
    raw = _with("train.precision", "16-mixed")
    raw["train"]["accelerator"] = "gpu"
    assert parse_params(raw).train.precision == "16-mixed"
    assert parse_params(_with("train.precision", "bf16-mixed")).train.precision == "bf16-mixed"


@pytest.mark.parametrize(
    ("key", "instead"),
    [
        ("gradient_clip_val", "configure_gradient_clipping"),
        ("accumulate_grad_batches", "raise the data's batch_size"),
        ("max_steps", "whole epochs (train.max_epochs)"),
        ("val_check_interval", "validates after each"),
    ],
)
def test_a_trainer_argument_under_train_says_what_to_do_instead(key: str, instead: str) -> None:
    for source in ("file", "override"):
        with pytest.raises(ConfigError) as refused:
            if source == "file":
                parse_params(params_with({f"train.{key}": 1}))
            else:
                load_params(ROOT / "params.yaml", [f"train.{key}=1"])
        line = str(refused.value)
        assert f"'train.{key}' is a Lightning Trainer argument" in line and instead in line
        assert "\n" not in line
    # Control: a key that is no Trainer argument is an unknown key, as before.
    with pytest.raises(ConfigError, match=r"unknown key 'train\.bogus'"):
        load_params(ROOT / "params.yaml", ["train.bogus=1"])
