"""A small training loop shared by the pipeline tests: the same data, model, seed and plain AdamW for a
1-process reference and for a pipelined run on real gloo ranks, so the two can be compared exactly.

Every loop here divides each micro-batch's loss by the number of micro-batches (as the trainer does),
and the comparison includes the first step's *gradients*, not only the parameters: AdamW is almost
invariant to a constant gradient scale, so a wrongly scaled pipeline loss would pass a parameter-only
check. One `run_ranks` call runs a list of cases in sequence, to pay process start-up once. Ranks return numpy
arrays (torch tensors would travel as shared-memory handles that die with the process).

Both sides run in float64 (model, activations sent between stages, gradients, AdamW state, loss), so the
comparison holds to `EXACT_RTOL` (1e-10) whatever kernels the CPU picks (tests/reference_loop.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pentatron.data.loader import TokenDataset, TokenLoader
from pentatron.distributed.context import ParallelContext
from pentatron.layout import ParallelLayout
from pentatron.models.config import ModelConfig
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.pipeline.engine import PipelineEngine, measured_bubble
from pentatron.parallel.pipeline.stages import build_stages, stage_layers, sync_tied_grads
from pentatron.precision import wide
from pentatron.schedules import make_schedule
from tests.reference_loop import EXACT_RTOL

SEQ, MICRO, M, STEPS, LR, SEED = 32, 1, 8, 10, 1e-3, 0
DTYPE = torch.float64  # both sides (the exact parity suite)


@dataclass(frozen=True)
class Case:
    schedule: str
    v: int = 1
    tied: bool = True
    n_layers: int = 8
    m: int = M
    steps: int = STEPS
    layers: tuple[int, ...] | None = None  # an explicit split (layers per stage); None: the runtime's own

    @property
    def label(self) -> str:
        split = "-layers" + ",".join(map(str, self.layers)) if self.layers else ""
        return (f"{self.schedule}{'-v' + str(self.v) if self.v > 1 else ''}{'' if self.tied else '-untied'}{split}"
                f"-m{self.m}")


def model_config(case: Case) -> ModelConfig:
    """The debug model (vocab 4096 to match the test corpus), narrowed to keep the CI cost low."""
    base = get_model_config("debug" if case.tied else "debug-untied")
    return dataclasses.replace(base, n_layers=case.n_layers, hidden_size=64, n_heads=2, n_kv_heads=1,
                               ffn_hidden_size=128)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(wide(logits).flatten(0, 1), targets.flatten())


def _loader(dataset_dir: Path, m: int) -> TokenLoader:
    return TokenLoader(TokenDataset(Path(dataset_dir)), seq_len=SEQ, micro_batch=MICRO, global_batch=m * MICRO,
                       seed=SEED)


def _optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def reference_run(case: Case, dataset_dir: Path) -> dict[str, Any]:
    """The 1-process run: whole model, gradient accumulation over the micro-batches."""
    return _reference_run(case, dataset_dir)


def _reference_run(case: Case, dataset_dir: Path) -> dict[str, Any]:
    model = build_model(model_config(case), seed=SEED, dtype=DTYPE)
    opt = _optimizer(list(model.parameters()))
    loader = _loader(dataset_dir, case.m)
    losses, grads = [], {}
    for step in range(case.steps):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=DTYPE)
        mbs = loader.next_step()
        for inputs, targets in mbs:
            loss = loss_fn(model(inputs), targets)
            (loss / len(mbs)).backward()
            total += loss.detach()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(total / len(mbs)))
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def pipeline_worker(rank: int, world_size: int, cases: list[Case], dataset_dir: str) -> list[dict[str, Any]]:
    """On each of `world_size` pipeline ranks, train every case; return what this rank holds."""
    ctx = ParallelContext.from_layout(ParallelLayout(pp=world_size), "cpu")
    pp_rank, p = ctx.coords["pp"], world_size
    results = []
    for case in cases:
        cfg = model_config(case)
        schedule = make_schedule(case.schedule, p, case.m, case.v)
        model = build_model(cfg, seed=SEED, dtype=DTYPE)
        stages = build_stages(model, p, pp_rank, stage_layers(cfg, p, case.v, SEQ, layers=case.layers))
        del model
        params = {n: prm for st in stages for n, prm in st.named_parameters()}
        opt = _optimizer(list(params.values()))
        engine = PipelineEngine(stages, schedule, ctx.comm, pp_rank, loss_fn)
        loader = _loader(Path(dataset_dir), case.m)
        losses, grads, peaks, slots = [], {}, [], []
        for step in range(case.steps):
            opt.zero_grad(set_to_none=True)
            ctx.comm.ledger.begin_step()
            out = engine.step(loader.next_step())
            sync_tied_grads(stages, ctx.comm, pp_rank, p)
            if step == 0:
                grads = {n: prm.grad.numpy().copy() for n, prm in params.items()}
                comm = ctx.comm.ledger.end_step().bytes_map()
            opt.step()
            peaks.append(out.peak_in_flight)
            slots = out.slots
            bubble = measured_bubble(out, ctx.comm)
            if out.loss is not None:
                losses.append(float(out.loss))
        results.append({"case": case, "losses": losses, "grads": grads, "peaks": peaks, "slots": slots,
                        "comm": comm, "bubble": bubble, "strict": ctx.comm.strict,
                        "params": {n: prm.detach().numpy().copy() for n, prm in params.items()},
                        "layers": [st.layer_ids for st in stages]})
    return results


def reference_name(name: str, tied: bool) -> str:
    """The 1-process model names the tied weight `embed.weight` only; the last stage holds it as lm_head."""
    return "embed.weight" if tied and name == "lm_head.weight" else name


def assert_close(got: Any, want: torch.Tensor, what: str, rtol: float = EXACT_RTOL) -> None:
    """Relative error in the norm sense: ‖got − want‖ ≤ rtol · ‖want‖ (fp64 parity)."""
    got = torch.as_tensor(got)
    err = (got - want).norm().item()
    scale = want.norm().item()
    assert err <= rtol * max(scale, 1e-12), f"{what}: relative error {err / max(scale, 1e-12):.2e} > {rtol:g}"
