"""One parallel layout for the whole mesh, and the one set of rules that says whether it can run.

`ParallelLayout` holds the degrees (dp, tp, pp, cp, ep), the ZeRO stage, sequence parallelism, the
pipeline schedule and the batch geometry, and derives what used to be re-derived in several places:
the micro-batch count per step and the virtual stages per rank. `problems()` is the single validator
that config loading, the runtime (`parallelize`) and the planner all call, so the three can never
disagree about which layouts exist; every layout it accepts trains.

Pure arithmetic with no torch import: it runs before any process group starts and costs nothing in
the planner's inner loop. Messages name the configuration field to change (`parallel.tp=3 does not
divide model.n_heads=8`), in training and in the planner alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pentatron.models.config import ModelConfig
from pentatron.schedules import SCHEDULES, ScheduleError, make_schedule

Zero3Gather = Literal["micro_batch", "step"]
ZERO3_GATHER: tuple[str, ...] = ("micro_batch", "step")
CP_MODES: tuple[str, ...] = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees, sharding knobs and batch geometry of one run (dp already resolved). The one holder of
    the degrees: the `ParallelContext` is built from it (`from_layout`) and it is handed down to
    `parallelize`; the config only says how to make one (`Config.layout`).

    `micro_batch` and `global_batch` are sequences; `global_batch` is per optimizer step over all
    data-parallel ranks. `zero3_gather` (ZeRO-3 with pp > 1): "micro_batch" re-gathers each stage's
    layers for every micro-batch (least memory, m× the gather traffic), "step" keeps the stage gathered
    from its first forward to its last backward of the step (torchtitan's FSDP + PP choice).
    `cp_mode`: how the cp ranks share attention — "ring" (K/V blocks travel a ring), "ulysses"
    (all-to-all from sequence- to head-sharded) or "hybrid" (Ulysses over `cp_ulysses` ranks inside,
    ring over cp / cp_ulysses across). `pp_layers`: decoder layers of each pipeline stage (chunk) in
    stage order, e.g. fewer on the first and the last stage, which also hold the embedding and the head;
    None: the runtime's own split (equal chunks when interleaving, else balanced by cost).
    `dp_shard` (HSDP): the dp ranks ZeRO shards over, consecutive dp ranks (one node); the other
    dp / dp_shard are replicas of that shard group, and the shards' reduced gradients are all-reduced
    across them. 0 (or dp): ZeRO shards over all of dp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    zero3_gather: str = "micro_batch"
    cp_mode: str = "ring"
    cp_ulysses: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    seq_len: int = 1
    pp_layers: tuple[int, ...] | None = None
    dp_shard: int = 0

    # ------------------------------------------------------------------ derived
    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def virtual(self) -> int:
        """Chunks (virtual stages) per pipeline rank: pp_virtual when interleaving, else 1."""
        return self.pp_virtual if self.pp > 1 and self.pp_schedule == "interleaved" else 1

    @property
    def cp_ulysses_degree(self) -> int:
        """Ranks of a cp group that exchange heads by all-to-all (Ulysses)."""
        return {"ring": 1, "ulysses": self.cp}.get(self.cp_mode, self.cp_ulysses)

    @property
    def cp_ring_degree(self) -> int:
        """Ranks of a cp group that pass K/V blocks around a ring."""
        return self.cp // max(1, self.cp_ulysses_degree)

    @property
    def shard_degree(self) -> int:
        """The dp ranks ZeRO shards parameters, gradients and optimizer state over (all of dp without HSDP)."""
        return self.dp_shard or self.dp

    @property
    def replicate_degree(self) -> int:
        """HSDP: the replicas of each shard group (1 without HSDP)."""
        return max(1, self.dp // max(1, self.shard_degree))

    @property
    def hsdp(self) -> bool:
        return self.shard_degree < self.dp

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel replica (gradient accumulation)."""
        return max(1, self.global_batch // (self.dp * self.micro_batch)) if self.micro_batch > 0 else 1

    @property
    def grad_reduce_dims(self) -> tuple[str, ...]:
        """The mesh dimensions a (dense) parameter's gradient is averaged over."""
        return ("dp",) if self.cp == 1 else ("dp", "cp")

    def short(self) -> str:
        s = f"dp{self.dp} tp{self.tp}{'+sp' if self.sp else ''} pp{self.pp} cp{self.cp}"
        if self.cp > 1:
            s += f"/{self.cp_mode}" + (f"{self.cp_ulysses}x{self.cp_ring_degree}" if self.cp_mode == "hybrid" else "")
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.pp > 1:
            s += f" {self.pp_schedule}" + (f"/v{self.virtual}" if self.virtual > 1 else "")
        return s + f" zero{self.zero}" + (f" hsdp{self.replicate_degree}x{self.shard_degree}" if self.hsdp else "")

    # ------------------------------------------------------------------ the rules
    def problems(self, model: ModelConfig | None = None, world_size: int | None = None) -> list[str]:
        """Every reason this layout cannot exist (empty when it can), each naming the field to change.
        `model`: checks that need its shape; `world_size`: the processes actually launched."""
        p: list[str] = []
        for name in ("dp", "tp", "pp", "cp", "ep", "pp_virtual", "cp_ulysses", "micro_batch", "global_batch",
                     "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                p.append(f"{_field(name)} must be an integer ≥ 1, got {v!r}")
        if p:
            return p  # the rest is arithmetic on these numbers
        if self.zero not in (0, 1, 2, 3):
            p.append(f"parallel.zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.zero3_gather not in ZERO3_GATHER:
            p.append(f"parallel.zero3_gather must be one of {', '.join(map(repr, ZERO3_GATHER))}, "
                     f"got {self.zero3_gather!r}")
        if world_size is not None and self.world != world_size:
            p.append(f"parallel.dp×tp×pp×cp = {self.dp}×{self.tp}×{self.pp}×{self.cp} = {self.world} does not "
                     f"equal the world size {world_size} (processes launched)")
        if (self.dp * self.cp) % self.ep:
            p.append(f"parallel.ep={self.ep} must divide dp×cp = {self.dp}×{self.cp} = {self.dp * self.cp} "
                     "(experts borrow those ranks)")
        if self.global_batch % (self.micro_batch * self.dp):
            p.append(f"train.global_batch={self.global_batch} is not divisible by train.micro_batch="
                     f"{self.micro_batch} × dp={self.dp}")
        p += self.context_problems(model)
        p += self.hsdp_problems()
        if model is not None:
            # Under cp each rank holds seq_len / cp tokens: that is what sequence parallelism splits.
            per_rank = f"the tokens per cp rank (train.seq_len / cp = {self.seq_len}/{self.cp})"
            p += tensor_parallel_problems(model, self.tp, self.sp, self.seq_len // self.cp,
                                          seq_field=per_rank if self.cp > 1 else "train.seq_len")
            p += expert_parallel_problems(model, self.ep)
            p += self.pipeline_problems(model)
        return p

    def degree_problems(self, world_size: int | None = None) -> list[str]:
        """What `problems` says about the degrees alone (a mesh to build, before any batch or model is
        known): the batch and sequence replaced by ones that trivially divide."""
        if any(isinstance(getattr(self, n), int) and getattr(self, n) < 1 for n in ("dp", "cp")):
            return self.problems(world_size=world_size)
        return replace(self, micro_batch=1, global_batch=self.dp, seq_len=2 * self.cp).problems(world_size=world_size)

    def hsdp_problems(self) -> list[str]:
        """HSDP's shard degree: a divisor of dp, used by a ZeRO stage, over dp alone."""
        s = self.dp_shard
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            return [f"parallel.dp_shard must be an integer ≥ 0 (0: shard over all of dp), got {s!r}"]
        if s and self.dp % s:  # also a shard degree above dp
            return [f"parallel.dp_shard={s} must divide parallel.dp={self.dp} (HSDP: dp / dp_shard replicas of a "
                    f"{s}-rank shard group)"]
        if not self.hsdp:
            return []
        p = []
        if self.zero == 0:
            p.append(f"parallel.dp_shard={s} < dp={self.dp} (HSDP) needs parallel.zero=1, 2 or 3: with zero=0 "
                     "nothing is sharded")
        if self.cp > 1:
            p.append(f"parallel.dp_shard={s} < dp={self.dp} (HSDP) is not supported with parallel.cp={self.cp} "
                     "(ZeRO then shards over dp×cp): set dp_shard=0 or cp=1")
        if self.ep > 1:
            p.append(f"parallel.dp_shard={s} < dp={self.dp} (HSDP) is not supported with parallel.ep={self.ep} "
                     "(expert weights shard over dp×cp / ep): set dp_shard=0 or ep=1")
        return p

    def context_problems(self, model: ModelConfig | None) -> list[str]:
        """The context-parallel mode, its degrees, and the sequence / heads they split."""
        if self.cp_mode not in CP_MODES:
            return [f"parallel.cp_mode must be one of {', '.join(map(repr, CP_MODES))}, got {self.cp_mode!r}"]
        u, r = self.cp_ulysses_degree, self.cp_ring_degree
        if self.cp_mode != "hybrid" and self.cp_ulysses != 1:
            return [f"parallel.cp_ulysses={self.cp_ulysses} is only used with parallel.cp_mode='hybrid'"]
        if self.cp_mode == "hybrid" and (u < 2 or u >= self.cp or self.cp % u):
            return [f"parallel.cp_mode='hybrid' needs parallel.cp_ulysses to divide parallel.cp={self.cp} and lie "
                    f"strictly between 1 and cp (got {self.cp_ulysses}); use cp_mode='ring' or 'ulysses' for one kind"]
        if self.cp == 1:
            return []
        p: list[str] = []
        if r > 1 and self.seq_len % (2 * self.cp):
            p.append(f"parallel.cp={self.cp} ({self.cp_mode}) needs train.seq_len={self.seq_len} divisible by "
                     f"2·cp = {2 * self.cp} (the load-balanced ring splits a sequence into 2·cp chunks)")
        elif r == 1 and self.seq_len % self.cp:
            p.append(f"parallel.cp={self.cp} (ulysses) needs train.seq_len={self.seq_len} divisible by cp")
        if model is not None and u > 1 and model.n_heads % self.tp == 0:
            heads = model.n_heads // self.tp
            kv = max(1, model.n_kv_heads // self.tp)  # tp > n_kv: one replicated kv head per rank
            if heads % u:
                p.append(f"Ulysses over {u} ranks needs the attention heads per tp rank (model.n_heads / tp = "
                         f"{model.n_heads}/{self.tp} = {heads}) divisible by {u}: change parallel.cp"
                         + (" or parallel.cp_ulysses" if self.cp_mode == "hybrid" else ", or use cp_mode='ring'"))
            elif kv % u and u % kv:
                p.append(f"Ulysses over {u} ranks needs the kv heads per tp rank ({kv}) to divide by {u} or divide "
                         f"{u} (kv heads are then replicated)")
        return p

    def pipeline_problems(self, model: ModelConfig, layers: Sequence[int] | None = None,
                          min_layers: int = 1) -> list[str]:
        """The schedule, its micro-batch count and the partition of the layers into stages (`min_layers`:
        the fewest an explicit stage may hold; the planner evaluates 0, an embedding- or head-only chunk).
        `layers`: the split to check, by default `pp_layers`."""
        if self.pp <= 1:
            out = [f"parallel.pp_virtual={self.pp_virtual} needs parallel.pp > 1"] if self.pp_virtual > 1 else []
            if self.pp_layers is not None:
                out.append(f"parallel.pp_layers={list(self.pp_layers)} needs parallel.pp > 1")
            return out
        if layers is None:
            layers = self.pp_layers
        if self.pp_schedule not in SCHEDULES:
            return [f"parallel.pp_schedule={self.pp_schedule!r} is unknown; known: {', '.join(SCHEDULES)}"]
        out: list[str] = []
        if self.pp_virtual > 1 and self.pp_schedule != "interleaved":
            out.append(f"parallel.pp_virtual={self.pp_virtual} needs parallel.pp_schedule='interleaved' "
                       f"(got {self.pp_schedule!r})")
        if self.global_batch % (self.micro_batch * self.dp) == 0:
            try:
                make_schedule(self.pp_schedule, self.pp, self.microbatches, self.virtual)
            except ScheduleError as e:
                out.append(f"parallel.pp_schedule={self.pp_schedule!r} with pp={self.pp}, {self.microbatches} "
                           f"micro-batches per step (train.global_batch / (dp · train.micro_batch)): {e}")
        v = self.virtual
        if v > 1 and layers is None and model.n_layers % v:
            out.append(f"parallel.pp_virtual={v} does not divide model.n_layers={model.n_layers} (or list each "
                       "chunk's layers in parallel.pp_layers)")
        elif v > 1 and layers is None and model.n_layers % self.n_stages:
            out.append(f"model.n_layers={model.n_layers} is not divisible by pp × pp_virtual = {self.pp} × {v} = "
                       f"{self.n_stages}: interleaved chunks must hold equal numbers of layers (or list each "
                       "chunk's in parallel.pp_layers)")
        else:
            what = (f"pipeline stages (pp={self.pp} × pp_virtual={v})" if v > 1
                    else f"pipeline stages (pp={self.pp})")
            out += partition_problems(model.n_layers, self.n_stages, layers=layers, what=what,
                                      min_layers=min_layers)
        return out

    def warnings(self, node_size: int | None) -> list[str]:
        """Advice that is not an error."""
        return tensor_parallel_warnings(self.tp, node_size)


_BATCH_FIELDS = ("micro_batch", "global_batch", "seq_len")


def _field(name: str) -> str:
    return f"train.{name}" if name in _BATCH_FIELDS else f"parallel.{name}"


# ---------------------------------------------------------------- rules by dimension
def resolve_dp(world_size: int | None, *, dp: int | None, tp: int = 1, pp: int = 1, cp: int = 1
               ) -> tuple[int | None, list[str]]:
    """(dp, problems): `dp=None` means whatever tp·pp·cp leave of `world_size` (None: not known yet)."""
    inner = tp * pp * cp
    if world_size is None or inner < 1:
        return dp, []
    if dp is None:
        if world_size % inner:
            return None, [f"world size {world_size} is not divisible by tp×pp×cp = {inner}"]
        return world_size // inner, []
    if dp * inner != world_size:
        return dp, [f"parallel.dp×tp×pp×cp = {dp}×{tp}×{pp}×{cp} = {dp * inner} does not equal the world size "
                    f"{world_size} (processes launched)" + (f"; dp={dp} does not divide the world size"
                                                             if world_size % dp else "")]
    return dp, []


def tensor_parallel_problems(model: ModelConfig, tp: int, sp: bool, seq_len: int | None = None,
                             seq_field: str = "train.seq_len") -> list[str]:
    """Every reason `model` cannot be split `tp` ways (empty when it can).

    The vocabulary must divide by tp: we do not pad it (as Megatron does), because padding changes the
    embedding's shape in checkpoints and exports and needs masked logits; every registry model's
    vocabulary divides by 8."""
    if tp < 1:
        return []  # reported with the other degrees
    p: list[str] = []
    if sp and tp == 1:
        p.append("parallel.sp=true needs parallel.tp > 1 (the sequence is sharded over the tp ranks)")
    if tp == 1:
        return p
    if model.n_heads % tp:
        p.append(f"parallel.tp={tp} does not divide model.n_heads={model.n_heads}")
    elif model.n_kv_heads % tp and tp % model.n_kv_heads:
        # tp > kv heads is fine when each kv head is replicated on tp/n_kv ranks; it must divide evenly.
        p.append(f"parallel.tp={tp} must divide model.n_kv_heads={model.n_kv_heads}, or be a multiple of it "
                 f"(kv heads are then replicated, up to tp = n_heads = {model.n_heads})")
    if model.ffn_hidden_size % tp:
        p.append(f"parallel.tp={tp} does not divide model.ffn_hidden_size={model.ffn_hidden_size}")
    if model.vocab_size % tp:
        p.append(f"parallel.tp={tp} does not divide model.vocab_size={model.vocab_size} (the vocabulary is "
                 "sharded over tp and is not padded)")
    if sp and seq_len is not None and seq_len % tp:
        shown = f"{seq_field}={seq_len}" if seq_field == "train.seq_len" else f"{seq_field[:-1]} = {seq_len})"
        p.append(f"parallel.sp=true needs {shown} to be divisible by parallel.tp={tp}")
    return p


def expert_parallel_problems(model: ModelConfig, ep: int) -> list[str]:
    """Every reason `model`'s experts cannot be split `ep` ways (empty when they can)."""
    if ep <= 1:
        return []
    if model.moe is None:
        return [f"parallel.ep={ep} needs an MoE model (model.moe is not set for {model.name!r})"]
    if model.moe.n_experts % ep:
        return [f"parallel.ep={ep} does not divide moe.n_experts={model.moe.n_experts}"]
    return []


def tensor_parallel_warnings(tp: int, node_size: int | None) -> list[str]:
    """A tp group spanning nodes runs its per-layer all-reduces over the slow inter-node network."""
    if node_size is not None and tp > node_size:
        return [f"parallel.tp={tp} is larger than the node size ({node_size} devices): tensor-parallel "
                "all-reduces will cross the inter-node network; keep tp within a node"]
    return []


def partition_problems(n_layers: int, n_stages: int, *, uniform: bool = False,
                       layers: Sequence[int] | None = None, what: str = "pipeline stages",
                       min_layers: int = 1) -> list[str]:
    """Every reason the layers cannot be split into `n_stages` contiguous stages (empty when they can)."""
    if n_stages < 1:
        return [f"the number of {what} must be ≥ 1, got {n_stages}"]
    if layers is not None:
        out = []
        if len(layers) != n_stages:
            out.append(f"parallel.pp_layers lists {len(layers)} stages but there are {n_stages} {what}")
        if any(not isinstance(c, int) or isinstance(c, bool) or c < min_layers for c in layers):
            out.append(f"parallel.pp_layers entries must be integers ≥ {min_layers}, got {list(layers)}")
        if sum(layers) != n_layers:
            out.append(f"parallel.pp_layers={list(layers)} sums to {sum(layers)}, but the model has "
                       f"{n_layers} layers")
        return out
    if n_layers < n_stages:
        return [f"model.n_layers={n_layers} is fewer than the {n_stages} {what}: every stage needs a layer"]
    if uniform and n_layers % n_stages:
        return [f"model.n_layers={n_layers} is not divisible by the {n_stages} {what}"]
    return []
