"""The GPT layer's activation memory as Korthikanti et al. 2022 (eqs. 1-4) and the Ultra-Scale Playbook
count it: 16-bit activations, dropout masks, a 4h GELU MLP and materialised attention scores, 34 sbh +
5 a s^2 b bytes per layer. The planner does not use it. The planner counts what our Llama keeps, tensor
by tensor (`pentatron.plan.memory.llama_layer_activation_bytes`). This formula is kept as the reference
that reproduces the playbook's published figures (research/tests/test_korthikanti_activation.py).

    python research/korthikanti_activation.py     # the playbook's 8B-like example, GiB for 32 layers
"""

from __future__ import annotations


def korthikanti_layer_activation_bytes(s: int, b: int, h: int, a: int, *, tp: int = 1, sp: bool = False,
                                       recompute: str = "none") -> float:
    """Activation bytes of one GPT layer (Korthikanti et al. 2022, eqs. 1-4; playbook "activation
    memory"): no TP  sbh(34 + 5as/h); TP  sbh(10 + 24/t + 5as/(ht)); TP+SP  sbh/t (34 + 5as/h).
    selective recompute drops the 5as/h attention-score term; full keeps only the layer input (2sbh,
    /t with SP)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    score = 0.0 if recompute == "selective" else 5 * a * s / h
    if tp == 1 or sp:
        return sbh * (34 + score) / tp
    return sbh * (10 + 24 / tp + score / tp)


if __name__ == "__main__":
    for rc in ("none", "selective", "full"):  # L=32, h=4096, a=32, s=1024, b=1: 9.25 / 4.25 / 0.25 GiB
        print(f"{rc:9s} {32 * korthikanti_layer_activation_bytes(1024, 1, 4096, 32, recompute=rc) / 2**30:.2f} GiB")
