"""The configuration reference (docs/configuration.md), generated from config.py — the one source: each
field's type and default from its dataclass, its description from the docstring under it (a leading
"[unit]" is the unit column). `tests/test_config_reference.py` regenerates the page and fails when it
differs, or when a field has no description.

    python -m pentatron.config_reference docs/configuration.md   # rewrite the page
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from pentatron.config import Config

HEADER = """# Configuration reference

Every field of a `pentatron train` TOML config (`[section]` tables) and of its `--set section.key=value`
overrides. Generated from `src/pentatron/config.py` by `python -m pentatron.config_reference
docs/configuration.md`; `tests/test_config_reference.py` fails when this page and the code differ.
"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` (a string literal right after its annotation)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _value(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def type_name(hint: Any) -> str:
    """A type hint as a config reader would write it: `int`, `"a" \\| "b"`, `list of int`, `… or unset`."""
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [o for o in get_args(hint) if o is not type(None)]
        return " or ".join(type_name(o) for o in options) + (" or unset" if type(None) in get_args(hint) else "")
    if origin is Literal:
        return " \\| ".join(_value(v) for v in get_args(hint))
    if origin is list:
        return f"list of {type_name(get_args(hint)[0])}"
    if dataclasses.is_dataclass(hint):
        return "table"
    return {bool: "true/false", str: "string"}.get(hint, getattr(hint, "__name__", str(hint)))


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def section_rows(cls: type) -> list[tuple[str, str, str, str, str]]:
    """(field, type, default, unit, description) of each field; ValueError naming an undocumented one."""
    docs, hints = field_docs(cls), get_type_hints(cls)
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
    if missing:
        raise ValueError(f"{cls.__name__}: no description for {', '.join(missing)} (a docstring under the field)")
    rows = []
    for f in dataclasses.fields(cls):
        text, unit = docs[f.name], "-"
        if text.startswith("[") and "]" in text:
            unit, text = text[1:text.index("]")], text[text.index("]") + 1:].strip()
        rows.append((f.name, type_name(hints[f.name]), _value(_default(f)), unit, text.replace("|", "\\|")))
    return rows


def reference_markdown() -> str:
    out = [HEADER]
    hints = get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = hints[section.name]
        intro = " ".join((inspect.getdoc(cls) or "").split()).removeprefix(f"[{section.name}]: ")
        out += [f"## [{section.name}]", "", intro, "", "| field | type | default | unit | what it does |",
                "|---|---|---|---|---|"]
        out += [f"| `{n}` | {t} | `{d}` | {u} | {text} |" for n, t, d, u, text in section_rows(cls)]
        out.append("")
        for f in dataclasses.fields(cls):  # a list of tables (`[[data.sources]]`): its keys, one table below
            inner = get_args(get_type_hints(cls)[f.name])
            if inner and dataclasses.is_dataclass(inner[0]):
                doc = " ".join((inspect.getdoc(inner[0]) or "").split())
                out += [f"### [[{section.name}.{f.name}]]", "", doc, "",
                        "| key | type | default | unit | what it does |", "|---|---|---|---|---|"]
                out += [f"| `{n}` | {t} | `{d}` | {u} | {text} |" for n, t, d, u, text in section_rows(inner[0])]
                out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/configuration.md")
    target.write_text(reference_markdown())
    print(f"wrote {target}")
