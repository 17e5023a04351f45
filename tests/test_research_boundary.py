"""The product never depends on the research tier (research/README.md): no module of the package or of its
tests imports a study, or builds a path into research/ to load one by file."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDIES = {p.stem for p in (ROOT / "research").glob("*.py")}


def _references(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in STUDIES]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in STUDIES:
            found.append(node.module)
        elif isinstance(node, ast.Constant) and node.value == "research":  # Path(...) / "research"
            found.append("'research'")
    return found


def test_the_studies_are_found():
    assert {"caching_allocator", "nanotron_replay", "playbook_sweep"} <= STUDIES


def test_neither_the_package_nor_its_tests_reach_into_research():
    files = [f for f in [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
             if f != Path(__file__).resolve()]  # this checker names the folder itself
    bad = {str(f.relative_to(ROOT)): refs for f in files if (refs := _references(f))}
    assert not bad, f"the product uses research/: {bad}"
