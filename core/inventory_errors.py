"""Errors in the inventory, located: a field path to ``file:line``, a schema error or a value YAML cannot read to
one line that says what is wrong and how to fix it, and bad values shown short however large they are."""

from __future__ import annotations

import difflib
import math
import re
import reprlib
import typing
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from core.errors import InventoryError


class ShortRepr(reprlib.Repr):
    """reprlib's short repr, also for integers too long for repr() (over 4300 digits)."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4096:
            return f"a number of about {int(x.bit_length() * math.log10(2))} digits"
        return super().repr_int(x, level)


# Shows a bad value in one short line, however big or deeply aliased (YAML anchors can nest a billion items).
SHORT = ShortRepr()
SHORT.maxstring = SHORT.maxother = 60
SHORT.maxlevel = 2


# What a field with a pattern holds, and how to write one (names: cluster and node names).
_PATTERN_ERRORS = {
    "name": ("a valid name", "fix: use only letters, digits, '.', '_' and '-'"),
    "user": ("a user name", "fix: use only letters, digits, '.', '_' and '-', not starting with '.' or '-'"),
    "host": ("a host name or address",
             "fix: use a host name, an IP address or a ~/.ssh/config alias, without spaces or shell characters"),
}


def explain(error: Mapping[str, Any], model: type[Any]) -> tuple[str, str | None]:
    kind = error["type"]
    got = SHORT.repr(error.get("input"))
    if kind == "extra_forbidden":
        key = str(error["loc"][-1])
        fields = list(getattr(_model_at(model, error["loc"][:-1]), "model_fields", {}))
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(fields)}"
        return f"unknown key {SHORT.repr(key)}", f"fix: {hint}"
    if kind == "missing":
        return "required field is missing", f"fix: add '{error['loc'][-1]}'"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected a whole number, got {got}", None
    if kind in ("string_type",):
        return f"expected text, got {got}", None
    if kind == "literal_error":
        return f"got {got}; {error['msg'].lower()}", None
    if kind == "string_pattern_mismatch":
        what, fix = _PATTERN_ERRORS.get(error["loc"][-1], _PATTERN_ERRORS["name"])
        return f"{got} is not {what}", fix
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got {got}", None
    if kind in ("greater_than_equal", "less_than_equal", "too_short", "too_long"):
        return f"{got}: {error['msg'].lower()}", None
    if kind == "value_error":
        return str(error["msg"]).removeprefix("Value error, "), None
    return f"{error['msg']} (got {got})", None


def _model_at(model: type[Any], loc: tuple[str | int, ...]) -> type[Any]:
    """The schema a mapping at ``loc`` is validated against (a nested model's own keys for its unknown key)."""
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            continue  # a union's tag or a list index: the same model
        nested = [member for member in _members(field.annotation) if isinstance(member, type)
                  and issubclass(member, BaseModel)]
        if nested:
            model = nested[0]
    return model


def _members(annotation: Any) -> list[Any]:
    """The types an annotation admits (a union's members, an Annotated's type), flattened."""
    arguments = typing.get_args(annotation)
    if not arguments:
        return [annotation]
    return [member for argument in arguments for member in _members(argument)]


def shown_key(key: object) -> str:
    """A key or name as written when it is plain, else quoted and shortened (keeps the error one line)."""
    return key if isinstance(key, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", key) else SHORT.repr(key)


class Locator:
    """Turns a field path into ``file: line N: nodes[1] (name).field: message``."""

    def __init__(self, source: str, tree: yaml.Node | None) -> None:
        self.source = source
        self.tree = tree

    def at(self, loc: tuple[str | int, ...], message: str, label: str = "") -> str:
        path = ""
        for part in loc:
            path += f"[{part}]" if isinstance(part, int) else (f".{shown_key(part)}" if path else shown_key(part))
            if isinstance(part, int) and path.startswith("nodes") and path.count("[") == 1:
                path += label
        line = self._line(loc)
        where = f"{self.source}:{line}" if line else self.source
        return f"{where}: {path}: {message}" if path else f"{where}: {message}"

    def _line(self, loc: tuple[str | int, ...]) -> int | None:
        node = self.tree
        found = node.start_mark.line + 1 if node is not None else None
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                node = next((value for key, value in node.value if key.value == part), None)
                if node is None:
                    return found
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
            else:
                return found
            found = node.start_mark.line + 1
        return found


# Each demo worker's `memory:`. The planner keeps 64 MiB of a node in reserve, which leaves 3 MiB: room for 6
# of the demo model's 8 layers (0.48 MiB each with a 512-token KV cache), not for all 8 and the output layer
# (4.0 MiB). So the demo shards across both workers, as a model too big for one machine does, where identical
# workers would otherwise get every layer on one (the fastest plan). tests/test_planner.py checks both that
# and that the model fits on the two.


def validate(model: type[Any], data: Any, where: tuple[str | int, ...], locate: Locator,
              node_name: object = None) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # A misspelt key also shows up as the real key missing; the misspelling is the useful report.
        # And of a union's members, the one for the kind of value written (a mapping, a word) says what is wrong.
        errors = sorted(exc.errors(), key=lambda item: (item["type"] != "extra_forbidden", _other_kind(item)))
        error = errors[0]
        loc = where + tuple(part for part in error["loc"] if part not in _UNION_TAGS)
        message, fix = explain(error, model)
        label = f" ({shown_key(node_name)})" if isinstance(node_name, str) and node_name else ""
        raise InventoryError(locate.at(loc, message, label), fix) from None


def _other_kind(error: Mapping[str, Any]) -> bool:
    """Whether ``error`` is a union member's for another kind of value than the one written: a word where a
    mapping was written, or a mapping where a word was."""
    written = error.get("input")
    if isinstance(written, dict):
        return error["type"] in ("literal_error", "string_type")
    return error["type"] in ("dict_type", "model_type", "model_attributes_type")


# pydantic names union members in error locations; they mean nothing to a user.
_UNION_TAGS = frozenset({"literal['auto','remote','push']", "BuildPath", "int", "str", "constrained-int",
                         "function-after[_host_for_kind(), Node]", "literal['ngram','off']", "DraftModelSpec"})


def unconstructible(text: str, source: str) -> str:
    """``file:line: value is …`` for the first scalar that PyYAML's safe constructor refuses."""
    constructor = yaml.SafeLoader("")
    seen: set[int] = set()
    pending = [yaml.compose(text)]
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:  # aliases share nodes, and may form cycles
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            try:
                constructor.construct_object(node)
            except ValueError as exc:
                what = "a number with too many digits" if node.tag.endswith(":int") else (
                    f"not a valid date ({exc})" if node.tag.endswith(":timestamp") else f"unreadable ({exc})")
                return f"{source}:{node.start_mark.line + 1}: {SHORT.repr(node.value)} is {what}"
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(reversed(node.value))
        elif isinstance(node, yaml.MappingNode):
            pending.extend(item for pair in reversed(node.value) for item in reversed(pair))
    return f"{source}: a value cannot be read"
