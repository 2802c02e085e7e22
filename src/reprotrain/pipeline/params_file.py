"""``params.yaml`` read into the typed config of :mod:`reprotrain.pipeline.config`, and back.

Loading is strict: an unknown key, a missing key, a wrong type or an
out-of-range value raises :class:`~reprotrain.pipeline.config.ConfigError`
with one line naming the key and what is allowed; the CLI turns it into exit
code 2 before anything is written. ``key=value`` overrides apply before the
check. ``params.yaml`` must spell out every key, so the file DVC hashes is the
whole configuration (:func:`render_defaults`, ``reprotrain params --defaults``,
prints one).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from reprotrain.pipeline.config import (
    COMPONENT_HELP,
    Component,
    ConfigError,
    CpuConfig,
    Params,
    TrainConfig,
)
from reprotrain.pipeline.errors import yaml_line

#: Where every key, its rule and its default are listed (quoted in error messages).
DEFAULTS_HINT = "`reprotrain params --defaults`"


def load_params(path: str | Path, overrides: Iterable[str] = ()) -> Params:
    """Read ``path``, apply ``key=value`` overrides, validate, return frozen params."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found; run from the repository root") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML{yaml_line(err)}: fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: expected a mapping of keys at the top level; {DEFAULTS_HINT} prints a "
            "valid file"
        )
    for item in overrides:
        _apply_override(raw, item)
    return parse_params(raw, source=str(path))


def parse_recorded_params(raw: Mapping[str, Any], source: str) -> Params:
    """Params as a model file's metadata records them: under ``cpu.profile: portable``
    without ``cpu.threads``, which decided the speed alone (so any count writes the same
    bytes); read back as the default count."""
    cpu = raw.get("cpu")
    if isinstance(cpu, Mapping) and "threads" not in cpu:
        raw = {**raw, "cpu": {**cpu, "threads": CpuConfig().threads}}
    return parse_params(raw, source)


def parse_params(raw: Mapping[str, Any], source: str = "params") -> Params:
    """Validate a plain mapping into :class:`Params`."""
    params = _build(Params, raw, prefix="", source=source)
    prepare = params.prepare
    if prepare is not None and prepare.val_fraction + prepare.test_fraction >= 1:
        raise ConfigError(
            f"{source}: prepare.val_fraction + prepare.test_fraction must be below 1, got "
            f"{prepare.val_fraction} + {prepare.test_fraction}; lower one of them"
        )
    train = params.train
    if train.devices * train.num_nodes > 1 and train.strategy != "ddp":
        raise ConfigError(
            f"{source}: train.strategy: got {train.strategy!r} with train.devices "
            f"{train.devices} x train.num_nodes {train.num_nodes}; set train.strategy: ddp "
            "for more than one device"
        )
    if train.accelerator == "cpu" and train.precision == "16-mixed":
        raise ConfigError(
            f"{source}: train.precision: 16-mixed with train.accelerator: cpu, where Lightning "
            "trains bf16-mixed instead (the CPU's mixed precision), so the run's record would "
            "name a precision that did not run; set train.precision: bf16-mixed (or 32-true)"
        )
    if train.world_size_invariant and params.batch_size is not None:
        check_invariant_layout(train, params.batch_size, source)
    return params


def check_invariant_layout(
    train: TrainConfig, batch_size: int, source: str, batch_key: str = "data.init_args.batch_size"
) -> None:
    """Refuse a world size and batch layout that world-size invariance cannot keep
    (``batch_key``: where the batch size comes from, for the message)."""
    from reprotrain.distributed.microbatches import (
        invariant_layout_problem,  # torch: this mode only
    )

    world = train.devices * train.num_nodes
    if problem := invariant_layout_problem(batch_size, train.micro_batch_size, world):
        raise ConfigError(
            f"{source}: train.world_size_invariant: {problem} (train.devices x "
            f"train.num_nodes, {batch_key}, train.micro_batch_size); set e.g. "
            "batch_size: 64, train.micro_batch_size: 16 for world sizes 1, 2 and 4"
        )


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key=value; write e.g. train.max_epochs=5")
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.get(part)
        if child is None and part == "init_args" and "class_path" in node:
            # a section may leave init_args out (every argument has a default): the
            # class's argument list, not the file, decides which keys exist under it
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: unknown key {key!r}; {DEFAULTS_HINT} lists them")
        node = child
    if leaf not in node and parents[-1:] != ["init_args"]:
        if hint := _trainer_only(key):
            raise ConfigError(f"override {item!r}: {hint}")
        raise ConfigError(f"override {item!r}: unknown key {key!r}; {DEFAULTS_HINT} lists them")
    node[leaf] = yaml.safe_load(text)


_WHOLE_EPOCHS = "the pipeline trains whole epochs (train.max_epochs) and validates after each"
_STEP_LIMITS = (
    *("max_steps", "min_steps", "min_epochs", "max_time", "limit_train_batches"),
    *("limit_val_batches", "val_check_interval", "check_val_every_n_epoch"),
)
#: Lightning Trainer arguments a user may write under ``train``, and what to do instead.
TRAINER_ONLY = {
    **dict.fromkeys(
        ("gradient_clip_val", "gradient_clip_algorithm"),
        "clip in the module: configure_gradient_clipping, calling self.clip_gradients",
    ),
    "accumulate_grad_batches": "the pipeline sets it itself (world-size invariance uses it); "
    "raise the data's batch_size instead",
    **dict.fromkeys(_STEP_LIMITS, _WHOLE_EPOCHS),
    "deterministic": "set the top-level deterministic key (true, warn or false)",
    "benchmark": "the top-level deterministic key decides it",
}


def _trainer_only(key: str) -> str | None:
    """What to do instead of ``key``, where it is a Trainer argument written under ``train``."""
    section, _, name = key.partition(".")
    if section != "train" or name not in TRAINER_ONLY:
        return None
    return (
        f"'{key}' is a Lightning Trainer argument the pipeline does not take: {TRAINER_ONLY[name]}"
    )


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{source}: {where}: expected a mapping, got {raw!r}; write it as a section "
            f"({DEFAULTS_HINT} shows its keys)"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in raw:
        if name not in fields:
            allowed = ", ".join(fields)
            if hint := _trainer_only(prefix + name):
                raise ConfigError(f"{source}: {hint}; remove it (allowed here: {allowed})")
            raise ConfigError(
                f"{source}: unknown key '{prefix}{name}'; remove or rename it (allowed here: "
                f"{allowed})"
            )
    values: dict[str, Any] = {}
    for name, spec in fields.items():
        key = prefix + name
        kind = _section_type(hints[name])
        if raw.get(name) is None and kind is not hints[name]:  # an optional section, or null
            values[name] = None
            continue
        if name not in raw:
            raise ConfigError(
                f"{source}: missing key {key!r} ({_describe(spec, hints[name])}); add it "
                f"({_example(key, spec, hints[name])})"
            )
        if kind is Component:
            values[name] = parse_component(raw[name], key, source)
        elif dataclasses.is_dataclass(kind):
            values[name] = _build(kind, raw[name], f"{key}.", source)
        else:
            values[name] = _check(key, raw[name], hints[name], spec, source)
    return cls(**values)


def _section_type(hint: Any) -> Any:
    """``X`` for ``X | None`` (an optional section), else ``hint``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(hint) and len(args) == 1 else hint


def parse_component(raw: Any, key: str, source: str = "params") -> Component:
    """The shape of a ``{class_path, init_args, code}`` section; the class is not imported."""
    example = f"write e.g. {key}: {{class_path: mypkg.module.MyClass, init_args: {{}}}}"
    if not isinstance(raw, Mapping) or "class_path" not in raw:
        raise ConfigError(
            f"{source}: {key}: expected a mapping with class_path and init_args, got {raw!r}; "
            f"{example}"
        )
    for name in raw:
        if name not in ("class_path", "init_args", "code"):
            raise ConfigError(
                f"{source}: unknown key '{key}.{name}'; remove it (allowed here: class_path, "
                "init_args, code)"
            )
    class_path = raw["class_path"]
    if not isinstance(class_path, str) or not re.fullmatch(r"[A-Za-z_][\w.]*\.\w+", class_path):
        raise ConfigError(
            f"{source}: {key}.class_path: expected a dotted path such as mypkg.module.MyClass, "
            f"got {class_path!r}"
        )
    init_args = raw.get("init_args")
    init_args = {} if init_args is None else init_args
    if not isinstance(init_args, Mapping) or not all(isinstance(k, str) for k in init_args):
        raise ConfigError(
            f"{source}: {key}.init_args: expected a mapping of argument names to values, got "
            f"{init_args!r}; write e.g. {key}.init_args: {{}}"
        )
    code = raw.get("code") or []
    if not isinstance(code, list) or not all(isinstance(c, str) and c for c in code):
        raise ConfigError(
            f"{source}: {key}.code: expected a list of files or folders, got {code!r}; write "
            f"e.g. {key}.code: [src/mypkg, configs/vocab.txt]"
        )
    return Component(class_path, dict(init_args), tuple(code))


def _check(key: str, value: Any, kind: Any, spec: dataclasses.Field, source: str) -> Any:
    rules = spec.metadata
    fail = ConfigError(
        f"{source}: {key}: got {value!r}; expected {_describe(spec, kind)}; set e.g. "
        f"{key}: {_yaml_scalar(spec.default)}"
    )
    if "choices" in rules:
        if not any(type(value) is type(c) and value == c for c in rules["choices"]):
            raise fail
        return value
    if kind is float and type(value) in (int, float):
        value = float(value)
    elif type(value) is not kind:
        raise fail
    bounds = {
        "ge": lambda v, b: v >= b,
        "gt": lambda v, b: v > b,
        "le": lambda v, b: v <= b,
        "lt": lambda v, b: v < b,
    }
    if any(name in rules and not ok(value, rules[name]) for name, ok in bounds.items()):
        raise fail
    return value


def _describe(spec: dataclasses.Field, kind: Any) -> str:
    rules = spec.metadata
    if "choices" in rules:
        return "one of " + ", ".join(_yaml_scalar(c) for c in rules["choices"])
    if dataclasses.is_dataclass(_section_type(kind)):
        return "a section"
    text = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[kind]
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    limits = [f"{symbols[name]} {rules[name]}" for name in symbols if name in rules]
    return f"{text} {' and '.join(limits)}" if limits else text


def _example(key: str, spec: dataclasses.Field, kind: Any) -> str:
    """How to write ``key`` back: its default, or for a section, where to find it."""
    if dataclasses.is_dataclass(_section_type(kind)):
        return f"{DEFAULTS_HINT} prints the section"
    return f"default {key}: {_yaml_scalar(spec.default)}"


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def render_defaults() -> str:
    """A complete, commented ``params.yaml`` holding every default."""
    lines = ["# reprotrain parameters; every key is required (defaults shown).", ""]
    _render(Params, lines, indent="")
    return "\n".join(lines) + "\n"


def _render(cls: type, lines: list[str], indent: str) -> None:
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        kind = _section_type(hints[spec.name])
        if kind is Component:
            default = spec.default_factory()  # type: ignore[misc]
            lines.append(f"{indent}# {COMPONENT_HELP[spec.name]}")
            lines.append(f"{indent}{spec.name}:")
            lines.append(f"{indent}  class_path: {default.class_path}")
            lines.append(f"{indent}  init_args:")
            lines += [f"{indent}    {k}: {_yaml_scalar(v)}" for k, v in default.init_args.items()]
            continue
        if dataclasses.is_dataclass(kind):
            if kind is not hints[spec.name]:
                lines.append(f"{indent}# optional: {kind.__doc__}")
            lines.append(f"{indent}{spec.name}:")
            _render(kind, lines, indent + "  ")
            continue
        lines.append(f"{indent}# {spec.metadata['help']}; {_describe(spec, hints[spec.name])}")
        lines.append(f"{indent}{spec.name}: {_yaml_scalar(spec.default)}")
