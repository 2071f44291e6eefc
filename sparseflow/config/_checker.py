"""A checker of parsed YAML that reports where a bad entry sits.

Knows nothing of the run config's sections: it reads a YAML file (rejecting
repeated keys) and checks values as a section asks, each error a
`ConfigError` naming the file and the YAML path of the entry, e.g.
`configs/x.yaml: features[3].table: unknown table 'foo'; known tables: a, b`,
with a suggestion for a misspelled key, or where every key of an earlier
format went (`naming_moved_keys`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

import embedding


class ConfigError(embedding.SparseflowError, ValueError):
    """A config file that cannot be used; the message names the file and entry.

    Attributes:
      source: the config file, as given to `load_config`.
      yaml_path: the bad entry, e.g. `features[3].table` (empty: the whole file).
    """

    def __init__(self, source: str, yaml_path: str, message: str):
        where = f"{source}: {yaml_path}" if yaml_path else source
        super().__init__(f"{where}: {message}")
        self.source = source
        self.yaml_path = yaml_path


class _UnknownKeyError(ConfigError):
    """A key that `mapping` does not know, which `naming_moved_keys` may find has moved."""


@dataclasses.dataclass(frozen=True)
class Node:
    """A value of the parsed YAML and where it sits, for error messages."""

    value: Any
    source: str
    path: str

    def error(self, message: str) -> ConfigError:
        return ConfigError(self.source, self.path, message)

    def child(self, key: str | int) -> Node:
        if isinstance(key, int):
            path = f"{self.path}[{key}]"
        else:
            path = f"{self.path}.{key}" if self.path else key
        return Node(self.value[key], self.source, path)

    def missing(self, key: str) -> ConfigError:
        return Node(None, self.source, self.child_path(key)).error("missing required key")

    def child_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        """Whether the mapping holds `key` with a value (an empty `key:` counts as absent)."""
        return self.value.get(key) is not None


def type_name(value: Any) -> str:
    return {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "empty",
    }.get(type(value), type(value).__name__)


def mapping(
    node: Node, required: tuple[str, ...], optional: tuple[str, ...] = (), what: str = "key"
) -> None:
    """Checks `node` is a mapping with all `required` keys and no others.

    `what` names the keys in the message of an unknown one ("feature": a
    mapping by feature name).
    """
    if not isinstance(node.value, dict):
        raise node.error(f"expected a mapping, got {type_name(node.value)}")
    known = required + optional
    for key in node.value:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise _UnknownKeyError(
                node.source,
                node.child_path(str(key)),
                f"unknown {what}; {hint}known {what}s: {', '.join(known)}",
            )
    for key in required:
        if key not in node.value:
            raise node.missing(key)


@contextlib.contextmanager
def naming_moved_keys(root: Node, moved: Mapping[str, tuple[str, str]]) -> Iterator[None]:
    """Turns an unknown key in the block that has moved into one error naming every moved key.

    `moved` maps a key's former path (`[]`: every entry of a list, as in
    `features[].valency`) to `(its path now, how to write it)`; `<name>` in
    the path now stands for the `name` of the list entry the key was in.
    A file of an earlier format holds several such keys, which would
    otherwise show up one per run as unknown keys. Any other unknown key
    keeps its own error.
    """
    try:
        yield
    except _UnknownKeyError as unknown:
        found = {
            former: list(_nodes_at(root, re.findall(r"\[\]|[^.[\]]+", former), "<name>"))
            for former in moved
        }
        if all(node.path != unknown.yaml_path for nodes in found.values() for node, _ in nodes):
            raise
        groups = []
        for former, nodes in found.items():
            now, hint = moved[former]
            if nodes:
                places = (
                    f"{node.path} moved to {now.replace('<name>', name)}" for node, name in nodes
                )
                groups.append(f"{', '.join(places)} ({hint})")
        raise root.error(f"keys of an earlier config format: {'; '.join(groups)}") from unknown


def _nodes_at(node: Node, segments: list[str], name: str) -> Iterator[tuple[Node, str]]:
    """The nodes at `segments` under `node`, each with the name of its list entry.

    A part of the document that is not the mapping or list a segment needs
    holds no such key; the section's own checks report what it is.
    """
    if not segments:
        yield node, name
        return
    head, *rest = segments
    if head == "[]":
        if isinstance(node.value, list):
            for i, entry in enumerate(node.value):
                entry_name = entry.get("name") if isinstance(entry, dict) else None
                yield from _nodes_at(
                    node.child(i), rest, entry_name if isinstance(entry_name, str) else name
                )
    elif isinstance(node.value, dict) and head in node.value:
        yield from _nodes_at(node.child(head), rest, name)


def get(node: Node, key: str, kind: str, default: Any = None) -> Any:
    """The value at `key` (or `default` when absent), checked to be of `kind`.

    `kind` is one of "int", "number", "bool", "str", "list", "mapping".
    """
    if key not in node.value:
        return default
    return check_kind(node.child(key), kind)


def check_kind(node: Node, kind: str) -> Any:
    value = node.value
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str) and bool(value),
        "list": isinstance(value, list),
        "mapping": isinstance(value, dict),
    }[kind]
    if not ok:
        expected = {
            "int": "an integer",
            "number": "a number",
            "bool": "true or false",
            "str": "a non-empty string",
            "list": "a list",
            "mapping": "a mapping",
        }[kind]
        raise node.error(
            f"expected {expected}, got {type_name(value)} {value!r}"
            f"{_float_hint(value) if kind == 'number' else ''}"
        )
    return float(value) if kind == "number" else value


def _float_hint(value: Any) -> str:
    # YAML 1.1 reads an exponent without a dot (1e-3) as a string.
    try:
        float(value)
    except (TypeError, ValueError):
        return ""
    return f" (YAML reads it as a string; write it with a dot, e.g. {float(value):.1e})"


def integer(node: Node, key: str, default: Any = None, minimum: int = 1) -> Any:
    """The integer at `key` (or `default` when absent), checked to be >= `minimum`."""
    value = get(node, key, "int", default)
    if value is not None and value < minimum:
        raise node.child(key).error(f"must be an integer >= {minimum}, got {value}")
    return value


def choice(node: Node, key: str, choices: Mapping[str, Any] | tuple[str, ...], what: str) -> str:
    value = get(node, key, "str")
    if value not in choices:
        raise node.child(key).error(
            f"unknown {what} {value!r}; choose one of: {', '.join(choices)}"
        )
    return value


def enum_values(cls: type[enum.Enum]) -> tuple[str, ...]:
    """The values of `cls`'s members, the choices a config may write."""
    return tuple(member.value for member in cls)


def enum_choice(node: Node, key: str, default: enum.Enum, what: str) -> enum.Enum:
    """The member of `default`'s enum named by the value at `key`, or `default` when absent."""
    if key not in node.value:
        return default
    cls = type(default)
    return cls(choice(node, key, enum_values(cls), what))


def build(node: Node, cls: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`, its own checks reported at `node`."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise node.error(str(e)) from e


def typed_spec(node: Node, registry: Mapping[str, type], what: str) -> Any:
    """A spec dataclass chosen by `type`: `{type: <registry key>, <its parameters>}`.

    The accepted parameters are the dataclass's fields (numbers and flags),
    typed by their defaults, so a new parameter needs no change here.
    """
    if not isinstance(node.value, dict):
        raise node.error(f"expected a mapping with a 'type', got {type_name(node.value)}")
    if "type" not in node.value:
        raise node.missing("type")
    cls = registry[choice(node, "type", registry, f"{what} type")]
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    mapping(node, ("type",), tuple(fields))
    params = {
        name: get(node, name, "bool" if isinstance(default, bool) else "number")
        for name, default in fields.items()
        if name in node.value
    }
    return build(node, cls, params)


def named_list(node: Node, what: str, parse: Callable[[Node], Any]) -> dict[str, Any]:
    """Parses a non-empty list of named entries into a dict, rejecting duplicates."""
    items = check_kind(node, "list")
    if not items:
        raise node.error(f"at least one {what} is required")
    parsed: dict[str, Any] = {}
    first_index: dict[str, int] = {}
    for i in range(len(items)):
        entry = parse(node.child(i))
        if entry.name in parsed:
            where = node.child(i).child("name")
            raise where.error(
                f"duplicate {what} name {entry.name!r} (also at "
                f"{node.path}[{first_index[entry.name]}])"
            )
        parsed[entry.name] = entry
        first_index[entry.name] = i
    return parsed


def path(node: Node, key: str, config_dir: Path) -> Path | None:
    """The path at `key`, relative to `config_dir`; None when absent."""
    value = get(node, key, "str")
    return None if value is None else Path(os.path.abspath(config_dir / value))


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that rejects a key repeated in one mapping.

    Plain PyYAML keeps the last of repeated keys, which would hide a
    copy-and-paste mistake in a table or feature entry.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(file: Path, source: str) -> Any:
    """The YAML document of `file`; errors name `source`."""
    try:
        text = file.read_text()
    except OSError as e:
        raise ConfigError(source, "", f"cannot read the config: {e.strerror or e}") from e
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, "", f"invalid YAML: {where}{e.problem}") from e
    except yaml.YAMLError as e:
        raise ConfigError(source, "", f"invalid YAML: {e}") from e
