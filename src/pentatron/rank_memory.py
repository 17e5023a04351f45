"""What a rank holds beside the planner's tensors (plan/memory.py models a GPU run's tensors only): the RoPE
tables of `model.max_seq_len` and, on a CPU host, the process itself. Read by the memory preflight and by a
CPU run's report, so both count a rank the same way."""

from __future__ import annotations

from pentatron.config import Config

CPU_PROCESS_BYTES = 400 << 20  # one rank's resident set before its model (interpreter, torch, loader)


def rope_table_bytes(cfg: Config) -> int:
    m = cfg.model_config()
    return 2 * m.max_seq_len * m.head_dim * 4  # cos and sin, fp32, [max_seq_len, head_dim]
