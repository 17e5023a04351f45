"""The one reader of the text files a user names (a training config, `plan --model-file`, `--batch`,
`--hardware`, a Hugging Face config.json): any failure to read or decode one is a single line naming the
file and what to change — an `UnreadableFile` (a ValueError), which each entry point reports with exit code 2.

Why one reader: each caller used to catch the failures it had thought of (a missing file, bad TOML), and
anything else — random bytes, a UTF-16 file, a file it may not read — escaped as a traceback. A leaf
module (no pentatron import), so hardware/ and the planner read their files with it too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class UnreadableFile(ValueError):
    """A file the user named cannot be read as the text it should hold (exit code 2)."""


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of `path` (a byte-order mark is dropped); `what` names the file's role in the message,
    e.g. "config file", "--model-file"."""
    p = Path(path)
    name = f"{what} {str(p)!r}"
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise UnreadableFile(f"{name} does not exist") from None
    except IsADirectoryError:
        raise UnreadableFile(f"{name} is a directory; give a file") from None
    except PermissionError:
        raise UnreadableFile(f"{name} cannot be read: permission denied; make it readable "
                             "(chmod u+r) or give another file") from None
    except OSError as e:
        raise UnreadableFile(f"{name} cannot be read ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        kind = "UTF-16 text" if utf16 else f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
        raise UnreadableFile(f"{name} is {kind}; save it as UTF-8 text") from None


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    text = read_text(path, what)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UnreadableFile(f"{what} {str(path)!r}: not valid TOML: {e}") from None


def read_json(path: str | Path, what: str) -> Any:
    text = read_text(path, what)
    try:
        return json.loads(text)
    except ValueError as e:
        raise UnreadableFile(f"{what} {str(path)!r}: not valid JSON: {e}") from None
