"""Form helpers shared by every app: the services' errors shown next to the fields they name, or as one
line where there is no form (a flash message after a button, a management command's error).

Services raise one error type, Django's ``ValidationError``; the REST API translates it in one
place (``webapp.core.api.exception_handler``), pages and commands through the helpers here."""

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


def service_error_text(error: ValidationError) -> str:
    """A service's ValidationError as one line: its messages joined by "; "."""
    return "; ".join(error.messages)


def message_add_service_error(request, error: ValidationError) -> None:
    """Show a service's ValidationError as an error message on the next page (a button without a form)."""
    from django.contrib import messages

    messages.error(request, service_error_text(error))


def bounded_number_field(field_class: type[forms.Field], bounds: Range | None, **options) -> forms.Field:
    """An IntegerField or FloatField capped at the upper end of the Range the services enforce.

    Django's number fields already refuse NaN, Infinity, "1e309" and 1.5 for integers; the cap keeps a
    huge value from reaching the service. Lower ends are left to the config dataclass's own rules, whose
    messages say why (pass `min_value` to set one here).
    """
    if bounds is not None and bounds.maximum is not None:
        options.setdefault("max_value", bounds.maximum)
    return field_class(**options)
