"""Implementations behind ``sandboxes.tools``: one handler per tool plus shared text helpers."""
