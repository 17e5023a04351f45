"""The research tier (research/README.md): checks of the studies, run by `make test` after the product's
tests. The studies import each other and two of the product's benchmark modules (planner_accuracy, ranks)
as siblings, as they do when run as scripts, so both folders go on the end of sys.path here; the product's
tests (tests/) never import a study (tests/test_imports.py checks)."""

from __future__ import annotations

import sys
from pathlib import Path

RESEARCH = Path(__file__).resolve().parents[1]
BENCHMARKS = RESEARCH.parent / "benchmarks"

for folder in (str(RESEARCH), str(BENCHMARKS)):
    if folder not in sys.path:
        sys.path.append(folder)
