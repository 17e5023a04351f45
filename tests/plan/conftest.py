import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def accuracy() -> Any:
    """benchmarks/planner_accuracy.py as a module (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("planner_accuracy", BENCHMARKS / "planner_accuracy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["planner_accuracy"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
