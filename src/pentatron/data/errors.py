"""The one exception type for bad data: its message says what is wrong and what to change."""

from __future__ import annotations


class DataError(ValueError):
    """Input data, a tokenized dataset, or a data setting is unusable.

    The CLI turns it into exit code 2 with the message on stderr and no traceback, so the
    message must stand alone: name the file (and line) and say what to do about it.
    """
