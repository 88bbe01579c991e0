"""REST plumbing shared by every app: strict JSON, strict input serializers, bounded pages, one error mapping.

- `FiniteJSONParser` refuses `NaN`, `Infinity` and numbers that overflow a float (`1e309`), which
  Python's json would otherwise turn into non-finite floats that no database column accepts.
- `InputSerializer` refuses fields it does not know, naming them (a typo is never silently ignored).
- `BoundedLimitOffsetPagination` refuses `limit`/`offset` outside their ranges instead of passing
  them to SQL.
- `exception_handler` turns the services' error type (Django's `ValidationError`) into a 400 with
  the same field keys, or a 409 when every message is coded ``"conflict"`` (the object's state, not
  the input, forbids the action).
"""

from __future__ import annotations

import codecs

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers, status
from rest_framework.exceptions import ParseError
from rest_framework.exceptions import ValidationError as DRFValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.parsers import JSONParser
from rest_framework.response import Response

from webapp.core.validation import CONFLICT, Range, finite_json_loads, query_integer


class FiniteJSONParser(JSONParser):
    """application/json whose numbers are all finite; anything else is a 400 parse error."""

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return finite_json_loads(codecs.getreader(encoding)(stream).read())
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ParseError(f"JSON parse error - {exc}") from exc
        except RecursionError as exc:
            raise ParseError("JSON parse error - nested too deeply") from exc


class InputSerializer(serializers.Serializer):
    """A request body serializer that refuses unknown fields by name.

    `aliases` maps an older input name to the current one: it is still accepted (documented as
    deprecated) and never both at once.
    """

    aliases: dict[str, str] = {}

    def to_internal_value(self, data):
        if hasattr(data, "keys"):
            data = self._resolve_aliases(data)
            known = set(self.fields) | set(self.aliases)
            unknown = sorted(str(key) for key in data if key not in known)
            if unknown:
                raise DRFValidationError({
                    name[:100]: [self.unknown_field_message(name)] for name in unknown
                })
        return super().to_internal_value(data)

    def _resolve_aliases(self, data):
        present = {old: new for old, new in self.aliases.items() if old in data}
        if not present:
            return data
        clashes = [old for old, new in present.items() if new in data]
        if clashes:
            raise DRFValidationError({old: [f"give either {old} (old name) or {present[old]}, not both"]
                                      for old in clashes})
        resolved = {key: data[key] for key in data if key not in present}
        resolved.update({new: data[old] for old, new in present.items()})
        return resolved

    def unknown_field_message(self, name: str) -> str:
        return f"unknown field; accepted fields: {', '.join(sorted(self.fields))}"


class TypedConfigField(serializers.JSONField):
    """A JSON object of a typed config dataclass's fields, each checked for type and range.

    `check` is a function(data) -> dict raising Django's ValidationError keyed by field name, e.g.
    `typed_fields_check` bound to a dataclass and its bounds. The errors come back nested under the
    field: ``{"limits": {"max_turns": ["max_turns must be an integer between 1 and 500, got 1.5"]}}``.
    A JSON string holding the object is accepted too (multipart forms).
    """

    def __init__(self, *, check, **kwargs):
        self.check = check
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, str):
            try:
                data = finite_json_loads(data) if data.strip() else {}
            except (ValueError, RecursionError) as exc:
                raise serializers.ValidationError(f"not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be a JSON object")
        try:
            return self.check(data)
        except DjangoValidationError as error:
            raise serializers.ValidationError(_drf_detail(error)) from error


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """limit in [1, API_MAX_PAGE_SIZE], offset in [0, API_MAX_OFFSET]; anything else is a 400 naming it."""

    def get_limit(self, request):
        return self._bounded(request, self.limit_query_param, self.default_limit,
                             Range(1, settings.API_MAX_PAGE_SIZE))

    def get_offset(self, request):
        return self._bounded(request, self.offset_query_param, 0, Range(0, settings.API_MAX_OFFSET))

    @staticmethod
    def _bounded(request, name: str, default: int, bounds: Range) -> int:
        try:
            return query_integer(request.query_params, name, default=default, bounds=bounds)
        except ValueError as exc:
            raise DRFValidationError({name: [str(exc)]}) from None

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        ranges = {self.limit_query_param: (1, settings.API_MAX_PAGE_SIZE),
                  self.offset_query_param: (0, settings.API_MAX_OFFSET)}
        for parameter in parameters:
            low, high = ranges[parameter["name"]]
            parameter["schema"].update({"minimum": low, "maximum": high})
        return parameters


def _drf_detail(error: DjangoValidationError) -> dict | list:
    if hasattr(error, "error_dict"):
        return error.message_dict
    return {"detail": error.messages}


def _codes(error: DjangoValidationError) -> set[str | None]:
    if hasattr(error, "error_dict"):
        return {item.code for items in error.error_dict.values() for item in items}
    return {item.code for item in error.error_list}


def exception_handler(exc, context):
    """DRF's handler, plus the services' ValidationError: 400 (or 409 for state conflicts) by field, or 429
    with Retry-After for a per-user limit (webapp.accounts.limits.LimitExceeded)."""
    # Imported here: rest_framework.views resolves DEFAULT_PARSER_CLASSES (this module's parser) when
    # it is first imported, so importing it at the top would be circular for a process whose first
    # touch of DRF is its pagination system check (manage.py fleet_serve).
    from rest_framework.views import exception_handler as drf_exception_handler
    from rest_framework.views import set_rollback

    from webapp.accounts.limits import LimitExceeded

    if isinstance(exc, LimitExceeded):  # a per-user limit: 429, when to retry and which limit
        set_rollback()
        return Response(exc.body(), status=status.HTTP_429_TOO_MANY_REQUESTS,
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, DjangoValidationError):
        code = status.HTTP_409_CONFLICT if _codes(exc) == {CONFLICT} else status.HTTP_400_BAD_REQUEST
        set_rollback()
        return Response(_drf_detail(exc), status=code)
    return drf_exception_handler(exc, context)
