"""Configuration: a schema of dotted keys, YAML loading, overrides and validation.

Every key is declared once with its type, default, allowed values and a help
line (`declare`). Plug-ins declare their own keys when imported, so a user's
module listed under `plugins:` extends the schema before the config is
checked. Unknown keys, wrong types and bad values raise `ConfigError` with one
line naming the key and the fix.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Iterable

import yaml

from fedcore.kernel.config_keys import (_RESOLVERS, _VALIDATORS, SCHEMA, Key, _coerce, declare, fraction,
                                 lives_elsewhere, nearest_key, non_negative, positive, resolver, validator)
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.files import write_atomic

__all__ = ["Key", "Config", "declare", "lives_elsewhere", "validator", "resolver", "positive", "non_negative", "fraction", "load_config", "parse_override",
           "SCHEMA"]


def _flatten(tree: dict, prefix: str, out: dict) -> None:
    for name, value in tree.items():
        if not isinstance(name, str):
            raise ConfigError(f"config key {name!r} under '{prefix or '<top>'}' is not a string")
        dotted = f"{prefix}{name}"
        if isinstance(value, dict) and _heads_section(dotted):
            # a key with sub-keys (`executor: ray` and `executor.ray.*`) given as a mapping:
            # its own value under `name`, the sub-keys beside it
            rest = dict(value)
            if "name" in rest:
                out[dotted] = rest.pop("name")
            _flatten(rest, dotted + ".", out)
        elif dotted in SCHEMA or not isinstance(value, dict):
            if dotted not in SCHEMA:
                raise ConfigError(f"unknown config key '{dotted}'{nearest_key(dotted)}")
            out[dotted] = value
        else:
            if not value and not any(k.startswith(dotted + ".") for k in SCHEMA):
                raise ConfigError(f"unknown config section '{dotted}'{nearest_key(dotted)}")
            _flatten(value, dotted + ".", out)


def _heads_section(dotted: str) -> bool:
    """True for a declared scalar key that also has declared sub-keys (`executor`)."""
    key = SCHEMA.get(dotted)
    return key is not None and key.type is not dict and f"{dotted}.name" not in SCHEMA \
        and any(k.startswith(dotted + ".") for k in SCHEMA)


class Config:
    """A validated, flat mapping of dotted keys; `cfg.train.optimizer.lr` reads like the YAML.

    `sources` says where each set key's value came from (a file, the command line, a Python
    argument); keys left at their default are absent from it."""

    def __init__(self, values: dict[str, Any], sources: dict[str, str] | None = None):
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "sources", dict(sources or {}))

    def source(self, key: str) -> str:
        """Where `key`'s value came from: a file path, 'command line', ... or 'default'."""
        self[key]  # unknown keys raise with a hint
        return self.sources.get(key, "default")

    def __getitem__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(f"config key '{key}' is not declared{nearest_key(key)}") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def __getattr__(self, name: str) -> Any:
        return _Section(self._values, name)

    def section(self, prefix: str) -> dict[str, Any]:
        """The keys under `prefix.` as a flat dict with the prefix removed."""
        p = prefix + "."
        return {k[len(p):]: v for k, v in self._values.items() if k.startswith(p)}

    def with_overrides(self, **dotted: Any) -> "Config":
        """A re-validated copy with some keys changed (use '__' for '.')."""
        values, sources = dict(self._values), dict(self.sources)
        for k, v in dotted.items():
            values[k.replace("__", ".")] = v
            sources[k.replace("__", ".")] = "with_overrides"
        return _validated(values, sources)

    def as_tree(self) -> dict:
        """The nested form written to config.yaml."""
        tree: dict = {}
        for dotted in sorted(self._values):
            node = tree
            parts = dotted.split(".")
            for part in parts[:-1]:
                if not isinstance(node.get(part, {}), dict):
                    node[part] = {"name": node[part]}   # a key with sub-keys: see _flatten
                node = node.setdefault(part, {})
            if isinstance(node.get(parts[-1]), dict):
                node[parts[-1]]["name"] = self._values[dotted]
            else:
                node[parts[-1]] = self._values[dotted]
        return tree

    def dump(self, path: Path) -> None:
        write_atomic(path, safe_dump(self.as_tree(), sort_keys=True))

    def dump_sources(self, path: Path) -> None:
        """`key: where its value came from`, for every key not left at its default."""
        write_atomic(path, safe_dump(dict(sorted(self.sources.items())), sort_keys=False)
                     if self.sources else "{}\n")


def safe_dump(data: Any, **kwargs: Any) -> str:
    """yaml.safe_dump through libyaml where PyYAML was built with it: the same text, about ten
    times faster (a course writes its ~700 keys before it runs)."""
    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), **kwargs)


class _Section:
    def __init__(self, values: dict, prefix: str):
        self._values = values
        self._prefix = prefix

    def __getattr__(self, name: str) -> Any:
        dotted = f"{self._prefix}.{name}"
        if dotted in self._values:
            return self._values[dotted]
        if any(k.startswith(dotted + ".") for k in self._values):
            return _Section(self._values, dotted)
        raise AttributeError(f"config key '{dotted}' is not declared{nearest_key(dotted)}")


def _yaml_problem(exc: Exception) -> str:
    """A YAML error in one line: the problem and where (PyYAML's message spans several)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not KEY=VALUE (e.g. federate.total_round_num=5)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{text}': value is not valid YAML ({exc.problem})") from None
    return key.strip(), value


def _import_plugins(modules: Iterable[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"plugins: cannot import '{name}' ({exc}); is it on PYTHONPATH?") from None
        except ConfigError:
            raise
        except Exception as exc:  # the module itself is broken: say where, in one line
            tb = exc.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
            raise ConfigError(f"plugins: importing '{name}' failed{where}: "
                              f"{type(exc).__name__}: {exc}") from None


def load_builtin_plugins() -> None:
    """Import the packages whose modules declare keys and register plug-ins (by name, through
    the registry: the modules that declare keys import this one)."""
    from fedcore.kernel.registry import load_builtin
    load_builtin()


def read_yaml_file(path: Path, option: str) -> Any:
    """The parsed contents of the YAML file `option` names (None for an empty file), or a
    one-line ConfigError naming the option, the file and the problem."""
    if not path.is_file():
        raise ConfigError(f"{option}: '{path}' is a directory, not a YAML file" if path.is_dir()
                          else f"{option}: file '{path}' does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{option}: '{path}' is not valid YAML: {_yaml_problem(exc)}") from None


def _read_yaml(path: Path, option: str = "--cfg") -> dict:
    tree = read_yaml_file(path, option)
    if tree is None:
        raise ConfigError(f"{option}: '{path}' is empty; write the keys to change (or '{{}}' to run "
                          "every default)")
    if not isinstance(tree, dict):
        raise ConfigError(f"{option}: '{path}' must hold a mapping of config keys")
    return tree


class _NamesPlugins(Exception):
    """A config names plug-ins of its own: only the live schema can judge it."""


def _compose(item, values: dict, sources: dict, chain: tuple[Path, ...] = (),
             named_by: str = "--cfg", plugins: bool = True) -> None:
    """Merge one config (a YAML file with its `defaults:` first, or a mapping) into `values`;
    `named_by` says where a file was named (errors name it: --cfg, or the file listing it).
    Without `plugins`, a config that names plug-ins raises _NamesPlugins instead."""
    if isinstance(item, dict):
        tree, label, here = dict(item), "arguments", None
    else:
        here = Path(item)
        if here.resolve() in chain:
            raise ConfigError(f"defaults: '{here}' includes itself (through "
                              f"{' -> '.join(p.name for p in chain)})")
        tree, label = _read_yaml(here, named_by), str(here)
    bases = tree.pop("defaults", None) or []
    if isinstance(bases, (str, dict)):
        bases = [bases]
    if not isinstance(bases, list):
        raise ConfigError(f"defaults: in {label}: expected a list of config files, got {bases!r}")
    for base in bases:
        if not isinstance(base, (str, dict)):
            raise ConfigError(f"defaults: in {label}: {base!r} is not a file name")
        if isinstance(base, str) and here is not None:
            base = here.parent / base   # relative to the file that names it
        _compose(base, values, sources, chain + ((here.resolve(),) if here is not None else ()),
                 f"defaults of '{label}'", plugins)
    if tree.get("plugins") and not plugins:
        raise _NamesPlugins
    _import_plugins(tree.get("plugins") or [])
    flat: dict[str, Any] = {}
    _flatten(tree, "", flat)
    values.update(flat)
    sources.update(dict.fromkeys(flat, label))


def composed_keys(path: str | Path) -> dict[str, Any]:
    """The dotted keys a YAML config sets, the files under its `defaults:` merged first, as
    `load_config` composes them (plug-ins imported, nothing validated yet): for a tool that
    writes a config elsewhere, where the `defaults:` paths would no longer resolve."""
    load_builtin_plugins()
    values: dict[str, Any] = {}
    _compose(Path(path), values, {})
    return values


def import_named_plugins(paths: Iterable[str | Path] = (), overrides: Iterable[str] = ()) -> None:
    """Import the plug-in modules that config files (with their `defaults:`) and `plugins=`
    overrides name, so that their keys are known, e.g. to `--help-key`; nothing is validated."""
    for path in paths:
        composed_keys(path)
    for key, value in map(parse_override, overrides):
        if key == "plugins":
            _import_plugins(value or [])


def load_config(path: str | Path | dict | list | tuple | None = None, overrides: Iterable[str] = (),
                extra: dict[str, Any] | None = None, extra_source: str = "arguments",
                named_by: str = "--cfg") -> Config:
    """Compose configs, apply `KEY=VALUE` overrides and `extra`, import plug-ins, validate.

    `path` is a YAML path, a mapping (nested or dotted keys), or a list of them merged in
    order: a later value replaces an earlier one. A YAML file may name the files it extends
    under `defaults:` (paths relative to it); they are merged first, in order, and the file's
    own keys win. The result's `sources` records where each set value came from. `named_by`
    is how errors name where a file was given (`--cfg` on the command line).
    """
    load_builtin_plugins()
    items = [] if path is None else list(path) if isinstance(path, (list, tuple)) else [path]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for item in items:
        _compose(item, values, sources, named_by=named_by)
    pairs = [parse_override(o) for o in overrides]
    for key, value in pairs:
        if key == "plugins":
            _import_plugins(value or [])
    _import_plugins((extra or {}).get("plugins") or [])
    for key, value in pairs:
        if isinstance(value, dict) and (key not in SCHEMA or _heads_section(key)):
            flat: dict[str, Any] = {}
            _flatten({key: value}, "", flat)
        elif key not in SCHEMA:
            raise ConfigError(f"unknown config key '{key}'{nearest_key(key)}")
        else:
            flat = {key: value}
        values.update(flat)
        sources.update(dict.fromkeys(flat, "command line"))
    if extra:
        flat = {}
        _flatten(extra, "", flat)
        values.update(flat)
        sources.update(dict.fromkeys(flat, extra_source))
    return _validated(values, sources)


def _validated(values: dict[str, Any], sources: dict[str, str] | None = None) -> Config:
    resolved = {}
    for name, key in SCHEMA.items():
        resolved[name] = _coerce(key, values[name]) if name in values else key.default
    unknown = set(values) - set(SCHEMA)
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(f"unknown config key '{name}'{nearest_key(name)}")
    for derive in _RESOLVERS:
        derive(resolved)
    cfg = Config(resolved, sources)
    for check in _VALIDATORS:
        check(cfg)
    return cfg
