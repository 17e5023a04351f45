"""The expert-load heatmap reads the `moe` field of a run's records and writes expert_load.png."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pentatron.observe.moe_heatmap import expert_loads, write_expert_heatmap


def test_heatmap_sums_loads_over_steps(tmp_path: Path) -> None:
    records = [{"step": s, "moe": {f"layers.{i}.moe": {"tokens_per_expert": [s, 2 * s, 0, i]} for i in (1, 10, 2)}}
               for s in (1, 2, 3)]
    loads = expert_loads(records)
    assert sorted(loads) == ["layers.1.moe", "layers.10.moe", "layers.2.moe"]
    np.testing.assert_array_equal(loads["layers.2.moe"], [6, 12, 0, 6])
    path = write_expert_heatmap(tmp_path, records)
    assert path == tmp_path / "expert_load.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_expert_heatmap(tmp_path / "dense", [{"step": 1, "loss": 1.0}]) is None
