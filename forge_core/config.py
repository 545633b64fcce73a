"""Typed configs: a YAML file fills the script's dataclass tree, tyro dotted flags override it.

    python train_sft.py --config configs/sft/tiny.yaml --optim.lr 3e-4 --train.steps 200

Unknown keys and wrong types are errors that name the file and the key. User mistakes raise `ForgeError`;
`run_main` turns one into a single line and exit code 2 instead of a traceback on every rank.
"""

import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar, Union

import tyro
import yaml

__all__ = ["ForgeError", "load_config", "run_main", "config_to_dict"]

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
    return tyro.cli(cls, default=default, args=args, use_underscores=True, console_outputs=is_rank0,
                    description=f"{cls.__doc__ or ''}\nA YAML base can be given with --config FILE.")


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def run_main(main: Callable[[], Any]) -> None:
    """Run a script's main; a ForgeError becomes one line on stderr (tagged with the rank) and exit code 2."""
    try:
        main()
    except ForgeError as err:
        rank = os.environ.get("RANK")
        where = f"[rank {rank}] " if rank is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{where}{err}", file=sys.stderr, flush=True)
        _close_process_group()
        sys.exit(2)


def _close_process_group() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
    return _build(cls, raw, path, prefix="")


def _build(cls: type[T], raw: dict, path: Path, prefix: str) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (known: {', '.join(fields)})"
            raise ForgeError(f"config error: {path}: unknown key '{dotted}'{hint}")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ForgeError(f"config error: {path}: '{dotted}' must be a mapping, got {value!r}")
            values[key] = _build(kind, value, path, prefix=f"{dotted}.")
        else:
            values[key] = _check_type(value, kind, path, dotted)
    return dataclasses.replace(cls(), **values)


def _check_type(value: Any, kind: Any, path: Path, dotted: str) -> Any:
    ok, converted = _matches(value, kind)
    if not ok:
        raise ForgeError(f"config error: {path}: '{dotted}' expects {_type_name(kind)}, got {value!r}")
    return converted


def _matches(value: Any, kind: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(kind)
    if kind is Any:
        return True, value
    if origin is Literal:
        return value in typing.get_args(kind), value
    if origin in (Union, types.UnionType):
        for option in typing.get_args(kind):
            ok, converted = _matches(value, option)
            if ok:
                return True, converted
        return False, value
    if kind is type(None):
        return value is None, value
    if origin in (list, tuple):
        (item_kind, *_) = typing.get_args(kind) or (Any,)
        if not isinstance(value, list):
            return False, value
        checked = [_matches(v, item_kind) for v in value]
        return all(ok for ok, _ in checked), origin(v for _, v in checked)
    if origin is dict:
        return isinstance(value, dict), value
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), float(value) if isinstance(value, (int, float)) else value
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind is str:
        return isinstance(value, str), value
    if kind is bool:
        return isinstance(value, bool), value
    return isinstance(value, kind), value


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(kind))
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
