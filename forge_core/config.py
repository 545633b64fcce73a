"""Typed configs: a YAML file fills the script's dataclass tree, tyro dotted flags override it.

    python train_sft.py --config configs/sft/tiny.yaml --optim.lr 3e-4 --train.steps 200

Unknown keys, wrong types and numbers out of their field's range (`lr: PositiveFloat`) are errors that name
the file and the key. User mistakes raise `ForgeError`; `run_main` (forge_core/dist.py) turns one into a
single line and exit code 2 instead of a traceback on every rank.

Pydantic checks the YAML against the dataclass tree, strict and in JSON mode (its lax mode takes "0.1" for a
float, True for an int and 1 for a bool; its strict Python mode takes dataclass instances only, not mappings);
tyro's `default=` checks nothing (a wrong type is a warning, then used as given), so the final config, flags
applied, is checked again. `_describe` words pydantic's first error as one line: the dotted key, the field's
type or range, the value, or for an unknown key the closest one.
"""

import dataclasses
import difflib
import importlib
import importlib.util
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import pydantic
import tyro
import yaml

__all__ = ["ForgeError", "load_config", "config_to_dict", "import_symbol"]

T = TypeVar("T")


class ForgeError(Exception):
    """A mistake in the user's input (config, data, paths, layout): reported in one line, exit code 2."""


def load_config(cls: type[T], argv: list[str] | None = None) -> T:
    """`--config FILE` (optional) gives the YAML base; every other flag is a tyro override of it."""
    args = list(sys.argv[1:] if argv is None else argv)
    config_path, args = _pop_config_flag(args)
    default = cls()
    if config_path is not None:
        default = _from_yaml(cls, config_path)
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    cfg = tyro.cli(cls, default=default, args=args, use_underscores=True, console_outputs=is_rank0,
                   description=f"{cls.__doc__ or ''}\nA YAML base can be given with --config FILE.")
    try:
        _validate(cls, config_to_dict(cfg))
    except pydantic.ValidationError as err:
        raise ForgeError(f"config error: {_describe(cls, config_to_dict(cfg), err.errors()[0])}") from None
    return cfg


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def import_symbol(spec: str, default_file: str, key: str) -> Any:
    """What a config names: `name` (in `default_file`, which the script passes: its neighbour `rewards.py` or
    `environments.py`), `file.py:name` or `package.module:name`."""
    where, _, name = spec.rpartition(":")
    where = where or default_file
    try:
        module = _module_from_file(where) if where.endswith(".py") else importlib.import_module(where)
    except (ImportError, FileNotFoundError) as err:
        raise ForgeError(f"config error: {key}: cannot import '{where}' ({err})") from None
    if not hasattr(module, name):
        raise ForgeError(f"config error: {key}: no '{name}' in {where}")
    return getattr(module, name)


def _module_from_file(path: str) -> types.ModuleType:
    """The module a .py file defines, loaded once per process: the one already imported under its name when
    that is this file (so `import rewards` and `rewards.py:fn` give the same objects)."""
    file = Path(path).resolve()
    loaded = sys.modules.get(file.stem)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == file:
        return loaded
    loader = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    sys.modules.setdefault(file.stem, module)
    return module


def _pop_config_flag(args: list[str]) -> tuple[Path | None, list[str]]:
    for i, arg in enumerate(args):
        if arg == "--config":
            if i + 1 >= len(args):
                raise ForgeError("config error: --config needs a file path")
            return Path(args[i + 1]), args[:i] + args[i + 2:]
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1]), args[:i] + args[i + 1:]
    return None, args


def _from_yaml(cls: type[T], path: Path) -> T:
    if not path.is_file():
        raise ForgeError(f"config error: {path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ForgeError(f"config error: {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ForgeError(f"config error: {path}: the top level must be a mapping of sections")
    # a section the YAML gives keeps the script's defaults for the keys it leaves out (GRPO's optim.lr is not
    # OptimConfig's): the YAML is laid over the whole default tree before it is checked
    merged = _deep_merge(config_to_dict(cls()), raw)
    try:
        return _validate(cls, merged)
    except pydantic.ValidationError as err:
        raise ForgeError(f"config error: {path}: {_describe(cls, merged, err.errors()[0])}") from None


def _validate(cls: type[T], raw: dict) -> T:
    # the nested stdlib dataclasses inherit this wrapper's config (TypeAdapter(cls, config=...) refuses a dataclass)
    root = pydantic.create_model("YAMLConfig", config=(cls, ...),
                                 __config__=pydantic.ConfigDict(extra="forbid", strict=True))
    # YAML's dates and timestamps, which JSON has no type for, arrive as their text
    return root.model_validate_json(json.dumps({"config": raw}, default=str)).config


def _deep_merge(base: dict, override: dict) -> dict:
    return {**base, **{k: _deep_merge(base[k], v) if isinstance(base.get(k), dict) and isinstance(v, dict) else v
                       for k, v in override.items()}}


def _describe(cls: type, raw: dict, error: dict) -> str:
    """Pydantic's error in our words: the field's dotted key and type or range (for an item of a list, the
    list's) and the value; an unknown key gets the closest known one."""
    kind, value, dotted = cls, raw, []
    for key in error["loc"][1:]:
        if not (dataclasses.is_dataclass(kind) and isinstance(value, dict)):
            break
        hints = typing.get_type_hints(kind)
        if key not in hints:
            prefix = "".join(f"{k}." for k in dotted)
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (known: {', '.join(hints)})"
            return f"unknown key '{prefix}{key}'{hint}"
        kind, value, dotted = hints[key], value[key], [*dotted, key]
    name = ".".join(dotted)
    if error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"'{name}' {error['msg'].replace('Input should', 'must')}, got {error['input']!r}"
    if dataclasses.is_dataclass(kind):
        return f"'{name}' must be a mapping, got {value!r}"
    if typing.get_origin(kind) is Literal:
        return f"'{name}' expects one of {', '.join(map(repr, typing.get_args(kind)))}, got {value!r}"
    return f"'{name}' expects {_type_name(kind)}, got {value!r}"


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):    # `PositiveInt | None` is a typing.Union
        return " | ".join("None" if arg is type(None) else _type_name(arg) for arg in typing.get_args(kind))
    return str(kind).replace("typing.", "") if typing.get_origin(kind) else kind.__name__
