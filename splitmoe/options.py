"""Engine options: every field `option` declares in `splitmoe.config`, as ``LLM(**options)``
keywords (`engine_config`) and as the launchers' and the server's flags (`add_engine_args`,
`engine_args`). An unknown option is an error that names the closest known ones."""

from __future__ import annotations

import argparse
import difflib
from dataclasses import MISSING, Field, fields
from pathlib import Path

from splitmoe.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
)
from splitmoe.models.config import ModelConfig


def _int_or_auto(text: str) -> int | str:
    return text if text == "auto" else int(text)


# ---- engine options: one declaration, for LLM(**options) and the launchers' flags ------------
_SECTIONS = {
    "parallel": ParallelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "kv_transfer": KVTransferConfig,
}

_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "int | str": _int_or_auto}

_DEST = "engine:"  # the flags' namespace in a parser (a front end's own flags may share names)


def engine_options() -> dict[str, Field]:
    """Every engine option, name -> its config field (sections first, then `EngineConfig`'s)."""
    out = {f.name: f for cls in _SECTIONS.values() for f in fields(cls)}
    out.update((f.name, f) for f in fields(EngineConfig) if "help" in f.metadata)
    return out


def engine_config(model: str | Path | ModelConfig, **options) -> EngineConfig:
    """The `EngineConfig` of a checkpoint and engine options (`engine_options`); an unknown
    option is a TypeError that names the closest known ones."""
    known = engine_options()
    unknown = [name for name in options if name not in known]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=2)
            hints.append(f"{name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
        raise TypeError(
            f"unknown engine option {', '.join(hints)}; the options are: {', '.join(known)}"
        )
    if not isinstance(model, ModelConfig):
        model = ModelConfig.from_hf(model)
    sections = {
        key: cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})
        for key, cls in _SECTIONS.items()
    }
    top = {f.name: options[f.name] for f in fields(EngineConfig) if f.name in options}
    return EngineConfig(model=model, **sections, **top)


def _flag(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Adds a flag for every engine option but ``exclude`` to ``parser`` (read them back with
    `engine_args`; an option left unset is absent there, so the config's default holds)."""
    group = parser.add_argument_group("engine options")
    for name, f in engine_options().items():
        if name in exclude:
            continue
        kind = f.type.replace(" | None", "")
        default = f.default if f.default is not MISSING else None
        text = f.metadata["help"]
        if "default" not in text and kind != "bool":
            text += f" (default: {default})"
        extra = {"help": text, "dest": _DEST + name}
        if kind == "bool":
            action = "store_false" if default else "store_true"
            group.add_argument(_flag(f), action=action, default=argparse.SUPPRESS, **extra)
            continue
        if f.metadata.get("choices"):
            extra["choices"] = f.metadata["choices"]
        group.add_argument(_flag(f), type=_TYPES[kind], default=argparse.SUPPRESS, **extra)


def engine_args(args: argparse.Namespace) -> dict:
    """The engine options set on the command line (`add_engine_args`), as `engine_config`
    takes them."""
    return {k[len(_DEST) :]: v for k, v in vars(args).items() if k.startswith(_DEST)}
