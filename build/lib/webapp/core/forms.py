"""Form helpers shared by every app: the services' errors shown next to the fields they name."""

from __future__ import annotations

from django import forms
from django.core.exceptions import ValidationError

from webapp.core.validation import Range


def form_add_service_error(form: forms.Form, error: ValidationError, *, field_names: dict[str, str] | None = None) -> None:
    """Put a service's ValidationError on the form: each message on the field it names when the form has
    that field (after renaming by `field_names`, service name -> form name), else at the top of the form."""
    renames = field_names or {}
    if not hasattr(error, "error_dict"):
        form.add_error(None, error.messages)
        return
    for field, messages in error.message_dict.items():
        name = renames.get(field, field)
        form.add_error(name if name in form.fields else None, messages)


def bounded_number_field(field_class: type[forms.Field], bounds: Range | None, **options) -> forms.Field:
    """An IntegerField or FloatField capped at the upper end of the Range the services enforce.

    Django's number fields already refuse NaN, Infinity, "1e309" and 1.5 for integers; the cap keeps a
    huge value from reaching the service. Lower ends are left to the config dataclass's own rules, whose
    messages say why (pass `min_value` to set one here).
    """
    if bounds is not None and bounds.maximum is not None:
        options.setdefault("max_value", bounds.maximum)
    return field_class(**options)
