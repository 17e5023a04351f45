"""The diagnosis as a pure function of dumps: a missing receive on the pipeline, a silent rank, an
ordering cycle; and the new config fields' validation."""

from __future__ import annotations

import pytest

from pentatron.config import ConfigError, load_config, profile_steps
from pentatron.observe.hang_diagnosis import diagnose


def _rec(seq, op, dim, ranks, peer=None, done=False, step=5, micro=None):
    return {"seq": seq, "op": op, "dim": dim, "ranks": ranks, "peer": peer, "shape": [2, 8], "dtype": "bfloat16",
            "step": step, "micro": micro, "site": "pipeline/engine.py:200 (_send)", "t": 0.0, "done": done}


def _dump(rank, records, entered, stalled=9.0):
    return {"rank": rank, "time": 100.0, "step": 5, "micro": None, "stalled_s": stalled, "entered": entered,
            "completed": {}, "records": records, "main_stack": [f"somewhere.py:1 (f{rank}): x"]}


def test_missing_receive_on_the_pipeline_names_the_receiver():
    # rank 0 sent its 31st activation to rank 1; rank 1 has received only 30 and waits in a tp all-reduce
    # that rank 2 (its tp peer, fine) has entered too: rank 1 is the one not entering the receive.
    d0 = _dump(0, [_rec(31, "send", "pp", [0, 1], peer=1, micro=5)], {"pp:send:1": 31})
    d1 = _dump(1, [_rec(30, "recv", "pp", [0, 1], peer=0, done=True)], {"pp:recv:0": 30}, stalled=0.0)
    out = diagnose({0: d0, 1: d1}, {}, 2, 10.0, 0, "/tmp/x")
    assert out.culprits == [1]
    assert "rank 1 has not entered pp recv from rank 0 #31; rank 0 waits there (step 5 micro-batch 5" in out.text
    assert "rank 1's last op: pp recv from rank 0 #30" in out.text


def test_silent_rank_with_heartbeat():
    d0 = _dump(0, [_rec(8, "all_reduce", "dp", [0, 1])], {"dp": 8})
    beat = _dump(1, [_rec(7, "all_reduce", "dp", [0, 1], done=True)], {"dp": 7})
    beat["time"] = 95.5
    out = diagnose({0: d0}, {1: beat}, 2, 10.0, 0, "/tmp/x")
    assert out.culprits == [1]
    assert "rank 1 did not answer the dump request" in out.text and "last heartbeat 4.5 s before" in out.text
    assert "rank 1 has not entered dp all_reduce #8" in out.text and out.text.endswith("stuck rank: 1")


def test_ranks_waiting_on_each_other_in_different_orders():
    # rank 0 waits in dp #3 (rank 1 has entered only 2 dp ops); rank 1 waits in tp #4 (rank 0 entered 3).
    d0 = _dump(0, [_rec(3, "all_reduce", "dp", [0, 1])], {"dp": 3, "tp": 3})
    d1 = _dump(1, [_rec(4, "all_reduce", "tp", [0, 1])], {"dp": 2, "tp": 4})
    out = diagnose({0: d0, 1: d1}, {}, 2, 10.0, 0, "/tmp/x")
    assert out.culprits == [0, 1] and "entered ops in different orders" in out.text


def test_config_fields():
    cfg = load_config(None, ["distributed.timeout_s=5", "distributed.check_collectives=true",
                             "log.numerics_every=10", "log.profile='3:5'"])
    assert cfg.distributed.timeout_s == 5.0 and cfg.distributed.check_collectives
    assert profile_steps(cfg.log.profile) == (3, 5) and profile_steps("5:3") is None and profile_steps("x") is None
    with pytest.raises(ConfigError) as e:
        load_config(None, ["distributed.timeout_s=0", "log.numerics_every=-1", "log.profile='0:2'"])
    text = str(e.value)
    assert "distributed.timeout_s must be > 0" in text and "log.numerics_every must be ≥ 0" in text
    assert "log.profile must look like" in text
