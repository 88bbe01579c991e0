"""Text as the database can store it, shared by live task events and recorded rollouts."""

from __future__ import annotations

DISPLAY_CHARS = 4000
"""Characters of a tool result shown in a stored event; the full output is kept beside it."""


def storable_text(value):
    """`value` with NUL characters replaced by U+FFFD, through dicts and lists.

    PostgreSQL text and jsonb cannot hold NUL, and model output (a random or early checkpoint emits
    any byte) or a tool's output (a binary file) may contain it; storing it raw would fail the whole
    rollout or event write and lose it.
    """
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {storable_text(key): storable_text(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable_text(item) for item in value]
    return value
