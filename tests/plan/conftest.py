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


def uncalibrated(gpu: Any) -> Any:
    """`gpu` on the datasheet model alone, for tests of the model's own terms: our step's measured calibration
    (`Efficiency.our_step`, which scales our recipe's stage phases on H100/H200) and the slowest-chip factor
    (`Efficiency.chip_spread`, which scales every recipe's on n > 1 GPUs) left out."""
    import dataclasses

    return dataclasses.replace(gpu, efficiency=dataclasses.replace(gpu.efficiency, our_step={}, chip_spread=0.0))
