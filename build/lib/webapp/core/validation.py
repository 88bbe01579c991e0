"""Typed, bounded checks of user input shared by the forms, the REST API and the services.

Every number a user gives (task limits, experiment config, query parameters) is checked here before
it reaches a dataclass, the database or arithmetic: integers must be real integers (not booleans, not
1.5, not "1e309"), floats must be finite, and both must lie in a range whose upper end comes from
settings. A bad value is refused with a message naming the field, never a 500.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError

CONFLICT = "conflict"
"""Code of a service ValidationError caused by the object's state, not the input (the API answers 409)."""

MAX_STRING_CHARS = 1000
"""Longest string a typed config field accepts (paths, choices)."""


@dataclass(frozen=True)
class Range:
    """Inclusive bounds of one numeric field; None leaves that side open."""

    minimum: float | None = None
    maximum: float | None = None

    def describe(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f"between {_number(self.minimum)} and {_number(self.maximum)}"
        if self.minimum is not None:
            return f">= {_number(self.minimum)}"
        if self.maximum is not None:
            return f"<= {_number(self.maximum)}"
        return "any size"

    def contains(self, value: float) -> bool:
        return (self.minimum is None or value >= self.minimum) and (self.maximum is None or value <= self.maximum)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def integer_check(name: str, value: Any, bounds: Range) -> int:
    """A real integer in bounds (booleans, floats and strings are refused), or ValueError naming `name`."""
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer {bounds.describe()}, got {_shown(value)}")
    if not bounds.contains(value):
        raise ValueError(f"{name} must be an integer {bounds.describe()}, got {_shown(value)}")
    return value


def number_check(name: str, value: Any, bounds: Range) -> float:
    """A finite number in bounds (booleans and strings are refused), as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number {bounds.describe()}, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or not bounds.contains(number):
        raise ValueError(f"{name} must be a finite number {bounds.describe()}, got {_shown(value)}")
    return number


def text_check(name: str, value: Any, *, max_chars: int = MAX_STRING_CHARS) -> str:
    """A string without NUL characters (PostgreSQL refuses them) of at most `max_chars`."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {_shown(value)}")
    if "\x00" in value:
        raise ValueError(f"{name} must not contain NUL characters")
    if len(value) > max_chars:
        raise ValueError(f"{name} is {len(value)} characters long; the limit is {max_chars}")
    return value


def _field_kind(annotation: Any) -> tuple[type, bool]:
    """(int | float | bool | str, optional) of a dataclass field's resolved annotation."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        annotation = members[0] if len(members) == 1 else str
    return (annotation if annotation in (int, float, bool, str) else str), optional


def dataclass_field_kinds(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field of a typed config dataclass with its base type and whether None is allowed."""
    hints = typing.get_type_hints(cls)
    return {item.name: _field_kind(hints[item.name]) for item in dataclasses.fields(cls)}


def typed_value_check(name: str, value: Any, *, kind: type, optional: bool) -> Any:
    """One value checked against its field's type (finite for numbers); ValueError names the field."""
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} must be given (it may not be null)")
    if kind is bool:
        if type(value) is not bool:
            raise ValueError(f"{name} must be true or false, got {_shown(value)}")
        return value
    if kind is int:
        return integer_check(name, value, Range())
    if kind is float:
        return number_check(name, value, Range())
    return text_check(name, value)


def typed_fields_check(cls: type, data: Any) -> dict[str, Any]:
    """`data` checked field by field against the types of the dataclass `cls`.

    Returns the values converted (ints stay ints, numbers become floats). Raises a Django
    ValidationError whose keys are the field names, unknown fields included, so a form or API can
    put each message next to its field. The dataclass's own rules (which explain themselves) come
    next, then `ranges_check`.
    """
    if not isinstance(data, Mapping):
        raise ValidationError(f"must be a JSON object of {cls.__name__} fields, got {_shown(data)}")
    kinds = dataclass_field_kinds(cls)
    errors: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    for name, value in data.items():
        if not isinstance(name, str) or name not in kinds:
            errors[str(name)[:100]] = [f"unknown field; known fields: {', '.join(sorted(kinds))}"]
            continue
        kind, optional = kinds[name]
        try:
            values[name] = typed_value_check(name, value, kind=kind, optional=optional)
        except ValueError as error:
            errors[name] = [str(error)]
    if errors:
        raise ValidationError(errors)
    return values


def ranges_check(values: Mapping[str, Any], *, bounds: Mapping[str, Range]) -> None:
    """Each number of `values` (already type-checked) inside its field's range; a ValidationError by field."""
    errors = {
        name: [f"{name} must be {'an integer' if type(value) is int else 'a number'} {bounds[name].describe()}, "
               f"got {_shown(value)}"]
        for name, value in values.items()
        if name in bounds and value is not None and not isinstance(value, bool | str)
        and not bounds[name].contains(value)
    }
    if errors:
        raise ValidationError(errors)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a 64-bit float")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number; JSON numbers are finite")


def finite_json_loads(text: str | bytes) -> Any:
    """json.loads that refuses NaN, Infinity and overflowing numbers (ValueError)."""
    return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)


def query_integer(params: Mapping[str, str], name: str, *, default: int, bounds: Range) -> int:
    """An integer query parameter in bounds (its default when absent), or ValueError naming it."""
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 18:
        raise ValueError(f"{name} must be an integer {bounds.describe()}, got {_shown(raw)}")
    return integer_check(name, int(text), bounds)
