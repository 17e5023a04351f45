"""docs/configuration.md is generated from config.py (`pentatron.config_reference`): every field has a
description there, and the page is what the code says now."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from pentatron.config_reference import reference_markdown, section_rows

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_configuration_reference_is_generated_from_config_py():
    assert PAGE.read_text() == reference_markdown(), (
        "docs/configuration.md differs from config.py: run `PYTHONPATH=src python -m pentatron.config_reference "
        "docs/configuration.md`")


def test_every_field_has_a_type_default_and_description():
    from pentatron.config import TrainConfig

    rows = {name: (kind, default, unit, text) for name, kind, default, unit, text in section_rows(TrainConfig)}
    assert rows["warmup"] == ("int", "10", "optimizer steps", rows["warmup"][3]) and "lr × k / warmup" in rows[
        "warmup"][3]
    assert rows["resume_schedule"][0] == '"recompute" \\| "continue" \\| "restart"'
    assert rows["peak_tflops"][:3] == ("float or unset", "unset", "TFLOP/s per device")


def test_an_undocumented_field_is_named():
    @dataclass
    class Section:
        documented: int = 1
        """What it does."""
        bare: int = 2

    with pytest.raises(ValueError, match="Section: no description for bare"):
        section_rows(Section)
