"""Typed run configuration: TOML files, dotted command-line overrides, validation with clear errors.

A config is loaded in one pass that collects *every* problem (unknown keys, wrong types, bad values,
inconsistent combinations) and raises one `ConfigError` listing them all, before any process group
or model exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from pentatron.layout import ParallelLayout, resolve_dp
from pentatron.models.config import ModelConfig, MoEConfig
from pentatron.models.registry import get_model_config
from pentatron.numbers import INT64_MAX, INT64_MIN, number_problem
from pentatron.user_files import UnreadableFile, read_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """All the problems found in a configuration: one line for one problem, else one line each under a heading
    (the one-line contract: a single bad value is `pentatron: error: invalid configuration: <the problem>`)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        if len(problems) == 1:
            super().__init__(f"invalid configuration: {problems[0]}")
        else:
            super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class ModelSection:
    """[model]: a registry name, optionally with any shape field overridden (e.g. n_layers = 2). Unset
    fields (None) are the registry model's (or model.hf_config's)."""

    name: str = "debug"
    """A registry model (models/registry.py), e.g. debug, debug-moe, smollm-135m, llama3-8b, llama3.1-70b,
    qwen3-8b, mixtral-8x7b; an unknown name's error lists them all."""
    hf_config: str = ""
    """A Hugging Face model directory (or its config.json): the shape is read from it, as `checkpoint
    import-hf` reads it, instead of from the registry's `name`; the fields below still override it."""
    vocab_size: int | None = None
    """[tokens] Vocabulary size: rows of the embedding and of the LM head; must exceed every token id of the
    dataset's tokenizer."""
    hidden_size: int | None = None
    """The model width (d_model): each token's vector between the layers."""
    n_layers: int | None = None
    """Decoder layers (attention + MLP blocks)."""
    n_heads: int | None = None
    """Attention (query) heads; hidden_size / n_heads is the head dimension."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention): divides n_heads; n_heads means plain multi-head attention."""
    ffn_hidden_size: int | None = None
    """The MLP's inner width (SwiGLU: of each of its gate and up projections)."""
    max_seq_len: int | None = None
    """[tokens] The longest sequence the model takes (its RoPE tables); train.seq_len must not exceed it."""
    rope_theta: float | None = None
    """The RoPE base frequency (larger: slower rotation, longer contexts)."""
    norm_eps: float | None = None
    """RMSNorm's epsilon, added to the mean square before its square root."""
    tie_embeddings: bool | None = None
    """The LM head shares the embedding's weight (one matrix, its gradient the sum of both uses)."""
    mlp: Literal["swiglu", "gelu"] | None = None
    """The MLP: SwiGLU (Llama's, three matrices) or GELU (two)."""
    init_std: float | None = None
    """Standard deviation of the normal initialisation of the weight matrices."""
    qk_norm: bool | None = None
    """Qwen3's q/k RMSNorm: one gain over the head dimension for the queries and one for the keys, applied to
    every head after the projections and before RoPE (epsilon norm_eps)."""
    attn_head_dim: int | None = None
    """The attention head width, when it is not hidden_size / n_heads (Qwen3 0.6B, 4B, 32B: 128); q and the
    attention output are then n_heads · attn_head_dim wide. Even (RoPE)."""


@dataclass
class MoESection:
    """[moe]: overrides of the model's Mixture-of-Experts fields (`models/config.py` MoEConfig); unset: the
    registry's. n_experts, top_k and expert_ffn_size together turn a dense registry model into an MoE."""

    n_experts: int | None = None
    """Routed experts in each MoE layer."""
    top_k: int | None = None
    """Experts each token is routed to (≤ n_experts)."""
    expert_ffn_size: int | None = None
    """The MLP inner width of each expert (a SwiGLU)."""
    n_shared_experts: int | None = None
    """Always-on experts every token goes through besides its routed ones (DeepSeek); 0: none."""
    score: Literal["softmax", "sigmoid"] | None = None
    """The router's score of each expert: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)."""
    norm_topk_prob: bool | None = None
    """Renormalise a token's top-k routing weights to sum to 1."""
    route_scale: float | None = None
    """A factor on the routing weights (DeepSeek-V3's routed_scaling_factor)."""
    aux_loss_coef: float | None = None
    """Coefficient of the Switch/GShard load-balancing loss (which is 1.0 at a uniform load); 0: off."""
    z_loss_coef: float | None = None
    """Coefficient of the router z-loss (mean squared log-sum-exp of the router logits); 0: off."""
    bias_update_rate: float | None = None
    """[per optimizer step] DeepSeek-V3's auxiliary-loss-free balancing: each expert's selection bias moves
    by this much towards the mean load after every step; 0: off."""
    capacity_factor: float | None = None
    """Each expert takes at most ceil(factor × tokens × top_k / n_experts) of a micro-batch's assignments,
    the lowest-weighted beyond are dropped; unset: dropless."""
    first_dense_layers: int | None = None
    """The first this many layers keep a dense MLP (DeepSeek-V3: 3)."""


@dataclass
class ParallelConfig:
    """[parallel]: the layout — how the ranks split the work (layout.py holds the rules). The product
    dp × tp × pp × cp must equal the number of processes."""

    dp: int | None = None
    """[ranks] Data-parallel degree: replicas that each take a share of the global batch. Unset: whatever the
    world size leaves after tp × pp × cp."""
    tp: int = 1
    """[ranks] Tensor-parallel degree: each layer's matrices are split over this many ranks (attention by
    heads, the MLP by its width), with an all-reduce per block; best inside one node."""
    pp: int = 1
    """[ranks] Pipeline-parallel degree: the layers are cut into this many stages, each on its own ranks,
    and micro-batches flow through them (parallel.pp_schedule)."""
    cp: int = 1
    """[ranks] Context-parallel degree: each sequence is split over this many ranks (parallel.cp_mode)."""
    ep: int = 1
    """[ranks] Expert-parallel degree (MoE): the experts are shared out over this many ranks of dp × cp,
    tokens reach theirs by all-to-all."""
    zero: int = 0
    """ZeRO stage over the data-parallel ranks: 0 replicates everything; 1 shards the optimizer state; 2 also
    the gradients; 3 also the parameters (gathered before use)."""
    sp: bool = False
    """Sequence parallelism (with tp > 1): the activations outside attention and the MLP (norms, residual)
    are split along the sequence over the tp ranks instead of replicated."""
    pp_schedule: Literal["afab", "1f1b", "interleaved", "zb"] = "1f1b"
    """The pipeline schedule: all-forward-all-backward, 1F1B, interleaved 1F1B (parallel.pp_virtual chunks per
    rank) or zero-bubble ZB-H1 (weight gradients deferred into the bubble)."""
    pp_virtual: int = 1
    """[chunks per rank] Model chunks on each pipeline rank for the interleaved schedule; 1 otherwise."""
    zero3_gather: Literal["micro_batch", "step"] = "micro_batch"
    """ZeRO-3 with pp > 1: re-gather a stage's layers for every micro-batch (least memory) or once per step
    (fewer gathers)."""
    cp_mode: Literal["ring", "ulysses", "hybrid"] = "ring"
    """Context parallelism: ring (K/V blocks passed around a ring), ulysses (heads all-to-all) or hybrid
    (Ulysses over parallel.cp_ulysses ranks inside a node, ring across)."""
    cp_ulysses: int = 1
    """[ranks] cp_mode = "hybrid": the Ulysses degree; the ring degree is cp / cp_ulysses."""
    pp_layers: list[int] | None = None
    """Decoder layers per pipeline stage (per chunk when interleaving), in stage order, e.g. [15, 17, 17, 15]
    to leave room for the embedding on the first stage and the head on the last; unset: the runtime's split."""
    dp_shard: int = 0
    """[ranks] HSDP (hybrid sharded data parallelism): ZeRO (parallel.zero = 1, 2 or 3) shards over groups of this
    many consecutive dp ranks (one node) instead of all of dp; the dp / dp_shard groups are replicas whose
    gradient shards are all-reduced across nodes. Must divide dp; 0: shard over all of dp (plain ZeRO)."""
    bucket_mb: float = 25.0
    """[MiB] Size of the gradient buckets data parallelism reduces while backward still runs (overlap)."""
    overlap_param_gather: bool = True
    """ZeRO-1/2: after the optimizer step the updated parameters' all-gathers are issued asynchronously, in
    forward order, in buckets of parallel.bucket_mb of parameters, and each is waited just before the first
    module using it, so only the first is exposed and the rest run behind the forward; false: all waited
    right after the step (exposed)."""


@dataclass
class TrainConfig:
    """[train]: the optimization — steps, batch, learning-rate schedule, AdamW, precision, kernels."""

    steps: int = 100
    """[optimizer steps] The run's length; the LR schedule spans it."""
    seq_len: int = 256
    """[tokens] Tokens per training sequence (≤ model.max_seq_len)."""
    micro_batch: int = 8
    """[sequences] Sequences in one forward/backward of one data-parallel replica; global_batch / (dp ×
    micro_batch) micro-batches are accumulated per step (the pipeline's micro-batches)."""
    global_batch: int = 8
    """[sequences] Sequences per optimizer step over all data-parallel ranks (tokens per step: × seq_len)."""
    lr: float = 3e-3
    """The peak learning rate, reached at the end of the warmup."""
    min_lr_ratio: float = 0.1
    """[fraction of lr] Where the decay ends: cosine and WSD decay to lr × min_lr_ratio."""
    warmup: int = 10
    """[optimizer steps] Linear warmup: step k (1-based) of the first `warmup` steps uses lr × k / warmup;
    0: none."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """After the warmup: cosine decay over the remaining steps, WSD (warmup-stable-decay: the peak held, then a
    linear decay over the last decay_fraction of the steps) or constant."""
    decay_fraction: float = 0.2
    """[fraction of steps] WSD: the share of train.steps spent in the final decay."""
    resume_schedule: Literal["recompute", "continue", "restart"] = "recompute"
    """A resume whose schedule (steps, lr, warmup, schedule, min_lr_ratio, decay_fraction) differs from the
    checkpoint's (said in one line): "recompute" takes the new schedule at the absolute step, as if set from
    step 0 (the LR may jump); "continue" keeps the LR continuous at the resume step (the new shape from the
    current LR over the remaining steps); "restart" warms up again over the remaining steps. Exact rules:
    train/lr_schedule.py."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, applied to the matrices and embeddings (not to norm gains)."""
    beta1: float = 0.9
    """AdamW's first-moment (momentum) decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the square root of the second moment."""
    clip: float = 1.0
    """The global gradient-norm clip (over all parameters of all ranks); 0 disables."""
    precision: Literal["auto", "fp32", "bf16", "fp64"] = "auto"
    """auto: bf16 on CUDA, fp32 on CPU; bf16: bf16 parameters and compute with fp32 gradients and master
    weights; fp32 on CUDA runs its matmuls on TF32 tensor cores (the peak its MFU is taken against);
    fp64: everything float64 (exact parity tests, CPU)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation in backward: none, selective (the attention core, whose intermediates grow
    with seq_len²) or full (each block's forward again): less activation memory for more compute."""
    compile: Literal[True, False, "auto", "try"] = "auto"
    """torch.compile of each decoder block's compute (parallel/compile.py): true, false, "try" (compile; a
    region that fails warns and runs eagerly) or "auto" (compile where it pays: `COMPILE_AUTO_DEVICES`; the
    planner's default kernels follow it, plan/recipes.py)."""
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    """torch.compile's backend: inductor (generated kernels) or aot_eager (graphs without codegen: debug)."""
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"
    """FP8 GEMMs in the decoder's linear layers (attention projections, dense MLPs; parallel/fp8.py): torchao's
    tensorwise recipe (one scale per tensor) or rowwise (a scale per row; power-of-two scales). The LM head,
    embedding, norms and the MoE router and experts stay in train.precision. With precision fp64 (the exact-parity
    mode) the same FP8 operands are multiplied in float64. Every converted GEMM dimension must divide by 16. Under
    train.compile ("auto": on CUDA) the FP8 linears compile inside their blocks, which fuses their casts, except
    where a cast all-reduces its amax (tp, cp) or under the zero-bubble schedule: those casts run eagerly."""
    fp8_skip: list[str] = field(default_factory=list)
    """Decoder linear layers kept out of train.fp8, as module-path patterns (`*` any layer index), e.g.
    ["layers.0.*", "layers.31.*"] for the first and last layer, or ["layers.*.attn.o_proj"]."""
    seed: int = 0
    """Seeds the parameter initialisation (each parameter's from (seed, its name): the same in every layout)
    and the data order."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto (CUDA when available), cpu or cuda (one GPU per process, by LOCAL_RANK)."""
    peak_tflops: float | None = None
    """[TFLOP/s per device] The peak that MFU divides by; unset: the hardware table's (GPU) or the measured
    CPU peak."""
    nonfinite: Literal["skip", "stop"] = "stop"
    """A NaN/inf loss or gradient norm: skip the update (counted as skipped_steps), or stop (exit 3)."""
    allow_overcommit: bool = False
    """Start even when the planner predicts the run does not fit in memory."""
    loss_chunk_tokens: int = 1024
    """[tokens] The LM head + cross-entropy run over chunks of this many tokens, recomputed in backward
    (models/loss.py): the loss holds one chunk's fp32 logits, never the whole [tokens, vocab]; 0: full logits
    (F.cross_entropy)."""


@dataclass
class DataSource:
    """One `[[data.sources]]` table: a tokenized directory and its share of the training samples."""

    path: str = ""
    """A directory written by `pentatron tokenize` (the same tokenizer as every other source)."""
    weight: float = 1.0
    """Relative share of the training samples (> 0; the weights need not sum to 1)."""
    name: str = ""
    """What logs, the summary and the checkpoint call it; empty: the directory's name (names must differ)."""

    def label(self) -> str:
        return self.name or Path(self.path).name or self.path


@dataclass
class DataConfig:
    """[data]: the tokenized dataset, or a weighted mixture of them (data/mixture.py)."""

    path: str = ""
    """A directory written by `pentatron tokenize`; empty (and no data.sources): the built-in default corpus
    (Python's standard library, tokenized into data.cache_dir)."""
    sources: list[DataSource] = field(default_factory=list)
    """A weighted mixture instead of data.path: `[[data.sources]]` tables with `path`, `weight` (relative share,
    > 0) and an optional `name` (default: the directory's name). Each training sample's source is drawn by
    weight from the seed and the sample's global position (the same in every layout, exact at a resume); each
    source is read in its own shuffled order, its tokens consumed logged (metrics.jsonl `data_tokens`, the
    console at log steps), in the summary and saved in the checkpoint. A holdout ([eval]) is carved from each
    source's tail and validated per source. Set data.path or data.sources, not both."""
    on_exhausted: Literal["wrap", "stop"] = "wrap"
    """A source (or data.path) whose samples have all been trained: "wrap" starts its next epoch (a new
    shuffle), "stop" ends the run before the step that would reuse one: the step before is validated and saved
    as a run's last (exit 0; a resume of it stops at once, exit 2). Said in one console line either way."""
    cache_dir: str = ".cache/data"
    """Where the built-in default corpus is tokenized and cached."""
    default_corpus_bytes: int = 6_000_000
    """[bytes] How much of the built-in corpus's text to tokenize."""
    document_mask: bool = False
    """Train the packed documents as documents: attention is causal within each document and sees nothing
    across (every layout, context parallelism included). A document starts at each end-of-document token the
    tokenizer wrote (that token opens the next document, data/documents.py). Off by default: the unmasked run
    trains on the same tokens with cross-document context. The planner takes the lengths a run logs
    (`pentatron plan --mean-doc-tokens/--mean-sq-doc-tokens`), and MFU counts attention over each document's
    square (plan/flops.py)."""
    document_positions: bool = True
    """With data.document_mask: RoPE positions restart at 0 at each document (as Llama 3 trains); false keeps
    the sample's positions 0..seq_len−1. Without document_mask positions are always the sample's."""


@dataclass
class EvalConfig:
    """[eval]: the validation loss during training (train/validation.py): every `every` steps and after the
    last, the mean cross-entropy of the model over `batches` global batches of held-out data — the same
    sequences every time — and its perplexity, computed in the run's layout without touching training's
    gradients, optimizer state, data position or MoE biases. The held-out data is the tail of the training
    token stream (`holdout` or `holdout_tokens`: never trained on) or another tokenized directory (`path`)."""

    every: int = 0
    """[optimizer steps] Evaluate every this many steps and after the last step; 0: no evaluation."""
    batches: int = 1
    """[global batches] Batches per evaluation, each train.global_batch sequences of train.seq_len tokens: the
    first ones of the held-out data, in order, split over data-parallel ranks as training's."""
    holdout: float = 0.0
    """Share of the training token stream (data.path's, or the built-in corpus), at its end, held out for
    validation and never trained on (0 ≤ x < 1; rounded to whole tokens). Training then draws its samples
    from the rest only: fewer samples, so another shuffled order than the same config without a holdout.
    Held out whenever set, even with every = 0, so turning evaluation on or off never changes what is
    trained on; 0 (with holdout_tokens = 0): the whole stream, exactly as before [eval] existed. A resume
    with another holdout is refused (the order would change). With data.sources each source holds out its
    own tail and is validated apart (the validation loss: their mean weighted as the sources are)."""
    holdout_tokens: int = 0
    """[tokens] As `holdout`, a token count instead of a share (set one of the two; per source for
    data.sources)."""
    path: str = ""
    """A directory written by `pentatron tokenize` to validate on instead of a holdout (the same tokenizer as
    the training data); the training data is then used whole."""


@dataclass
class CheckpointConfig:
    """[checkpoint]: saving, resuming, retention."""

    dir: str = ""
    """The checkpoint directory (step_XXXXXXXX directories and a `latest` pointer); empty: no checkpoints."""
    every: int = 0
    """[optimizer steps] Steps between saves; 0: only at the end (when dir is set)."""
    keep: int = 2
    """[checkpoints] How many of this run's newest checkpoints to keep; older ones are deleted (never the one
    `latest` names)."""
    resume: bool = True
    """Continue from the newest checkpoint in dir if there is one (in any layout: re-sharded)."""
    async_save: bool = False
    """Stage the state to CPU and write it in the background (at most one save in flight)."""
    fallback: bool = False
    """The checkpoint `latest` names is damaged: resume from the newest older one that verifies instead of
    stopping."""
    force_new: bool = False
    """With resume = false: start a new run beside a directory's existing checkpoints (kept)."""
    resume_from: str = ""
    """A step directory of dir to resume ("step_00000100" or "100"); empty: what `latest` names."""
    save_on_sigterm: bool = False
    """SIGTERM (a scheduler's preemption notice, or to the launcher) or Ctrl-C (SIGINT): finish the current step,
    save, exit 143 (130 after Ctrl-C). Off: the ranks stop at once and the run resumes from the last periodic
    checkpoint."""


@dataclass
class LogConfig:
    """[log]: metrics, progress, traces."""

    dir: str = "runs/default"
    """Each run writes into <dir>/<YYYYmmdd-HHMMSS> (metrics.jsonl, report.md, summary.json, config.json);
    <dir>/latest links the newest; a resumed run continues in its run's directory."""
    every: int = 1
    """[optimizer steps] Print a console row every this many steps (metrics.jsonl has every step)."""
    tensorboard: bool = True
    """Also write TensorBoard event files (<run>/tensorboard)."""
    wandb: bool = False
    """Also log to Weights & Biases (rank 0: the config, each step's TensorBoard scalars, validation, the run
    summary) into <run>/wandb; needs `pip install 'pentatron[wandb]'`. A resumed run continues its W&B run."""
    wandb_project: str = "pentatron"
    """W&B project of the run."""
    wandb_name: str = ""
    """W&B display name of the run; empty: the run directory's name."""
    wandb_mode: str = ""
    """"online", "offline" (written to <run>/wandb only; `wandb sync` uploads it later) or empty: W&B's own
    choice (the WANDB_MODE environment variable, else online)."""
    progress: bool = True
    """A live progress bar on a terminal."""
    pp_trace: bool = False
    """Pipeline runs: dump each logged step's timeline as a Chrome trace into the log directory."""
    numerics_every: int = 0
    """[optimizer steps] Per-layer gradient/update/parameter norms and max |activation| every this many
    steps; 0: off."""
    profile: str = ""
    """"a:b": torch.profiler traces of steps a..b per rank into <run>/profile; empty: off."""


@dataclass
class DistributedConfig:
    """[distributed]: hang detection and collective checks."""

    timeout_s: float = 180.0
    """[seconds] No communication progress this long: the hang watchdog dumps, diagnoses and exits."""
    check_collectives: bool = False
    """Debug: before each collective the ranks compare its op, shape and sequence number, and a mismatch
    names both sides at once."""


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    moe: MoESection = field(default_factory=MoESection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def model_config(self) -> ModelConfig:
        base = hf_shape(self.model.hf_config) if self.model.hf_config else get_model_config(self.model.name)
        overrides = {k: v for k, v in dataclasses.asdict(self.model).items()
                     if k not in ("name", "hf_config") and v is not None}
        moe = {k: v for k, v in dataclasses.asdict(self.moe).items() if v is not None}
        if moe:
            needed = [f"moe.{k}" for k in ("n_experts", "top_k", "expert_ffn_size") if k not in moe]
            if base.moe is None and needed:
                raise KeyError(f"{base.name!r} has no experts: set {', '.join(needed)} to make it an MoE model")
            overrides["moe"] = dataclasses.replace(base.moe, **moe) if base.moe else MoEConfig(**moe)
        return dataclasses.replace(base, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved_dict(self, world_size: int) -> dict[str, Any]:
        """`to_dict()` with what the run resolves written in: the model's shape (the registry's or
        model.hf_config's, with the overrides) in [model] and, for an MoE, [moe] (a dense model has none);
        parallel.dp from the world size. It loads back as the same run (the config.json of a run directory)."""
        out = self.to_dict()
        model = self.model_config()
        out["model"].update({k: getattr(model, k) for k in out["model"] if k not in ("name", "hf_config")})
        if model.attn_head_dim is None:  # unset: the head width is derived (hidden / heads), nothing to resolve
            del out["model"]["attn_head_dim"]
        if model.moe is not None:
            out["moe"] = {k: getattr(model.moe, k) for k in out["moe"]}
        elif not any(v is not None for v in out["moe"].values()):  # a dense model: no [moe] of nulls
            del out["moe"]
        out["parallel"]["dp"] = self.layout(world_size).dp
        return out

    def layout(self, world_size: int | None = None) -> ParallelLayout:
        """The run's `ParallelLayout`; dp resolved from `world_size` when `parallel.dp` is unset."""
        par, tr = self.parallel, self.train
        dp = par.dp
        if dp is None:
            dp, _ = resolve_dp(world_size, dp=None, tp=par.tp, pp=par.pp, cp=par.cp)
        return ParallelLayout(dp=dp or 1, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, zero=par.zero, sp=par.sp,
                              pp_schedule=par.pp_schedule, pp_virtual=par.pp_virtual,
                              zero3_gather=par.zero3_gather, cp_mode=par.cp_mode, cp_ulysses=par.cp_ulysses,
                              dp_shard=par.dp_shard,
                              pp_layers=None if par.pp_layers is None else tuple(par.pp_layers),
                              micro_batch=tr.micro_batch,
                              global_batch=tr.global_batch, seq_len=tr.seq_len)


@functools.lru_cache(maxsize=8)
def hf_shape(path: str) -> ModelConfig:
    """`model.hf_config`: the shape of a Hugging Face directory (or of its config.json), named after the
    directory. Raises KeyError("model.hf_config …") when it cannot be read (config validation reports it)."""
    from pentatron.models.hf import read_hf_config  # imports torch: only for runs that use it

    p = Path(path)
    directory = p.parent if p.is_file() else p
    try:
        return dataclasses.replace(read_hf_config(directory), name=directory.resolve().name)
    except (OSError, ValueError) as e:
        raise KeyError(f"model.hf_config: {e}") from None


# ---------------------------------------------------------------- loading with type checks


def _check_value(path: str, value: Any, tp: Any, problems: list[str]) -> Any:
    """Check (and gently coerce int→float) one value against a type hint; record a problem if wrong."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        non_none = [o for o in options if o is not type(None)]
        sub: list[str] = []
        out = _check_value(path, value, non_none[0], sub)
        problems.extend(sub)
        return out
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            problems.append(f"{path} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{path} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path} must be an integer, got {value!r}")
        elif problem := number_problem(path, value, ge=INT64_MIN, le=INT64_MAX):
            problems.append(problem)  # TOML's integers are 64-bit; every consumer (torch, numpy) assumes it
        return value
    if tp is float:
        # every float field is finite: NaN passes a range check like `x <= 0`, inf trains nothing
        if problem := number_problem(path, value):
            problems.append(problem)
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path} must be a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):  # a table inside a section (`[[data.sources]]`)
        if not isinstance(value, dict):
            problems.append(f"{path} must be a table, got {value!r}")
            return value
        return _build_section(tp, path, value, problems, table=True)
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{path} must be a list, got {value!r}")
            return value
        sub = []
        out = [_check_value(f"{path}[{i}]", v, get_args(tp)[0], sub) for i, v in enumerate(value)]
        problems.extend(sub)
        return out
    raise TypeError(f"unsupported config type {tp!r} for {path}")  # a bug in this file, not user input


def field_problems(section: type, name: str, value: Any, path: str | None = None) -> list[str]:
    """What the config loader says about `value` as field `name` of `section` (a config dataclass, or
    any dataclass with typed fields): the same typed check, reusable where a value is not read from a
    file (the planner checks its knobs with it). `path` names the field in messages (default
    "<section>.<name>")."""
    problems: list[str] = []
    _check_value(path or f"{section.__name__}.{name}", value, _type_hints(section)[name], problems)
    return problems


def field_choices(section: type, name: str) -> tuple[Any, ...]:
    """The values a `Literal`-typed field admits (a command line's choices, the same list the checker uses)."""
    hint = _type_hints(section)[name]
    options = get_args(hint) if get_origin(hint) is not Literal else (hint,)
    return tuple(v for o in options if get_origin(o) is Literal for v in get_args(o))


@functools.lru_cache(maxsize=64)
def _type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _build_section(cls: type, name: str, data: Any, problems: list[str], table: bool = False) -> Any:
    if not table and not isinstance(data, dict):
        problems.append(f"[{name}] must be a table, got {data!r}")
        return cls()
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            close = difflib.get_close_matches(key, hints, n=1)
            hint = f" (did you mean {name}.{close[0]}?)" if close else ""
            problems.append(f"unknown key {name}.{key}{hint}")
            continue
        kwargs[key] = _check_value(f"{name}.{key}", value, hints[key], problems)
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any], world_size: int | None = None) -> Config:
    problems: list[str] = []
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = get_type_hints(Config)
    built = {}
    for key, value in data.items():
        if key not in sections:
            close = difflib.get_close_matches(key, sections, n=1)
            problems.append(f"unknown section [{key}]" + (f" (did you mean [{close[0]}]?)" if close else ""))
            continue
        built[key] = _build_section(hints[key], key, value, problems)
    cfg = Config(**built)
    if not problems:
        problems = validate(cfg, world_size)
    if problems:
        raise ConfigError(problems)
    return cfg


def parse_override(item: str) -> tuple[list[str], Any]:
    """'train.lr=1e-3' → (['train', 'lr'], 0.001). Values are read as TOML, else kept as strings."""
    if "=" not in item:
        raise ConfigError([f"override {item!r} must look like section.key=value"])
    key, raw = item.split("=", 1)
    parts = key.strip().lstrip("-").split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError([f"override key {key!r} must look like section.key (e.g. train.steps)"])
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def load_config(path: str | Path | None, overrides: list[str] = (), world_size: int | None = None) -> Config:
    """Read a TOML file (or start from defaults), apply `section.key=value` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        if Path(path).is_dir():
            raise ConfigError([f"config path {str(path)!r} is a directory; give a TOML file (e.g. configs/debug.toml)"])
        try:
            data = read_toml(path, "config file")
        except UnreadableFile as e:  # missing, unreadable, not UTF-8, not TOML: one line, exit 2
            raise ConfigError([str(e)]) from None
    for item in overrides:
        (section, key), value = parse_override(item)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError([f"[{section}] must be a table"])
        table[key] = value
    return config_from_dict(data, world_size)


# ---------------------------------------------------------------- semantic validation

# What `pentatron plan --emit-config` writes where only the user can say (the dataset, the checkpoint
# directory), followed by what to put there: a run refuses to start until each one is set.
PLACEHOLDER = "SET ME: "


def placeholder_problems(cfg: Config) -> list[str]:
    """A problem for every string field still holding a `PLACEHOLDER`."""
    out = []
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            v = getattr(getattr(cfg, section.name), f.name)
            if isinstance(v, str) and v.startswith(PLACEHOLDER):
                out.append(f"{section.name}.{f.name} is still the placeholder `pentatron plan --emit-config` wrote: "
                           f"set it to {v[len(PLACEHOLDER):]}")
    return out


def validate(cfg: Config, world_size: int | None = None) -> list[str]:
    """Every semantic problem with a type-correct config (empty list when valid)."""
    p: list[str] = placeholder_problems(cfg)
    try:
        model = cfg.model_config()
    except KeyError as e:  # an unknown registry name, or a model.hf_config that cannot be read (named)
        p.append(e.args[0] if str(e.args[0]).startswith("model.hf_config") else f"model.name: {e.args[0]}")
        model = None
    if model is not None:
        p += model.problems()

    par, tr = cfg.parallel, cfg.train
    if par.bucket_mb <= 0:
        p.append(f"parallel.bucket_mb must be > 0, got {par.bucket_mb}")
    dp = par.dp
    if min(par.tp, par.pp, par.cp, par.dp or 1) >= 1:  # otherwise reported by the layout below
        dp, found = resolve_dp(world_size, dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)
        p += found
    # The layout rules live in one place (`ParallelLayout.problems`), shared with the runtime and the
    # planner; an unresolved dp (world size not known yet) is checked as 1 and again once it is known.
    layout = dataclasses.replace(cfg.layout(world_size), dp=dp or 1)
    shape = model if model is not None and not model.problems() else None
    p += layout.problems(shape)

    if tr.steps <= 0:
        p.append(f"train.steps must be > 0, got {tr.steps}")
    if tr.lr <= 0:
        p.append(f"train.lr must be > 0, got {tr.lr}")
    if not 0 <= tr.min_lr_ratio <= 1:
        p.append(f"train.min_lr_ratio must be within [0, 1], got {tr.min_lr_ratio}")
    if tr.warmup < 0:
        p.append(f"train.warmup must be ≥ 0, got {tr.warmup}")
    elif tr.steps > 0 and tr.warmup > tr.steps:
        p.append(f"train.warmup={tr.warmup} is longer than train.steps={tr.steps}")
    if not 0 < tr.decay_fraction <= 1:
        p.append(f"train.decay_fraction must be within (0, 1], got {tr.decay_fraction}")
    if tr.weight_decay < 0:
        p.append(f"train.weight_decay must be ≥ 0, got {tr.weight_decay}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(tr, name) < 1:
            p.append(f"train.{name} must be within [0, 1), got {getattr(tr, name)}")
    if tr.eps <= 0:
        p.append(f"train.eps must be > 0, got {tr.eps}")
    if tr.clip < 0:
        p.append(f"train.clip must be ≥ 0 (0 disables clipping), got {tr.clip}")
    if type(tr.compile) is int or type(tr.compile) is float:  # 1 == True passes the Literal check
        p.append(f"train.compile must be true, false, \"auto\" or \"try\", got {tr.compile!r}")
    if model is not None and not model.problems():
        p += fp8_problems(tr, model, layout)
    if tr.loss_chunk_tokens < 0:
        p.append(f"train.loss_chunk_tokens must be ≥ 0 (0: the loss from full logits), got {tr.loss_chunk_tokens}")
    if problem := number_problem("train.seed", tr.seed, ge=0, le=INT64_MAX):  # what torch and numpy seed with
        p.append(problem)
    if tr.peak_tflops is not None and tr.peak_tflops <= 0:
        p.append(f"train.peak_tflops must be > 0, got {tr.peak_tflops}")
    if model is not None and tr.seq_len > model.max_seq_len:
        p.append(f"train.seq_len={tr.seq_len} is longer than the model's max_seq_len={model.max_seq_len}")

    if cfg.data.path and not cfg.data.path.startswith(PLACEHOLDER) and not Path(cfg.data.path).exists():
        p.append(f"data.path {cfg.data.path!r} does not exist (create it with `pentatron tokenize`)")
    p += sources_problems(cfg.data)
    if cfg.data.default_corpus_bytes <= 0:
        p.append(f"data.default_corpus_bytes must be > 0, got {cfg.data.default_corpus_bytes}")
    p += eval_problems(cfg.eval)
    if cfg.checkpoint.every < 0:
        p.append(f"checkpoint.every must be ≥ 0, got {cfg.checkpoint.every}")
    if cfg.checkpoint.keep < 1:
        p.append(f"checkpoint.keep must be ≥ 1, got {cfg.checkpoint.keep}")
    if cfg.checkpoint.save_on_sigterm and not cfg.checkpoint.dir:
        p.append("checkpoint.save_on_sigterm=true needs checkpoint.dir (where to save)")
    if cfg.checkpoint.resume_from and not cfg.checkpoint.dir:  # else the run would start from scratch
        p.append(f"checkpoint.resume_from={cfg.checkpoint.resume_from!r} (--resume-from) needs checkpoint.dir, "
                 "the directory holding that step")
    if cfg.checkpoint.resume_from and not cfg.checkpoint.resume:
        p.append("checkpoint.resume_from names a checkpoint to resume: it needs checkpoint.resume=true")
    if cfg.checkpoint.force_new and cfg.checkpoint.resume:
        p.append("checkpoint.force_new=true starts a new run: set checkpoint.resume=false too (--force-new sets both)")
    if cfg.log.every < 1:
        p.append(f"log.every must be ≥ 1, got {cfg.log.every}")
    if cfg.log.numerics_every < 0:
        p.append(f"log.numerics_every must be ≥ 0 (0 disables), got {cfg.log.numerics_every}")
    if cfg.log.wandb_mode not in ("", "online", "offline"):
        p.append(f"log.wandb_mode must be \"online\", \"offline\" or empty (W&B's default), got {cfg.log.wandb_mode!r}")
    if cfg.log.wandb and not cfg.log.wandb_project:
        p.append("log.wandb_project must name a W&B project (default \"pentatron\")")
    if cfg.log.profile and profile_steps(cfg.log.profile) is None:
        p.append(f"log.profile must look like \"a:b\" with 1 ≤ a ≤ b (steps to trace), got {cfg.log.profile!r}")
    # beyond ~31 years a timeout overflows the process group's timedelta; nobody waits that long
    if problem := number_problem("distributed.timeout_s", cfg.distributed.timeout_s, gt=0, le=1e9):
        p.append(problem)
    return p


def sources_problems(data: DataConfig) -> list[str]:
    """data.sources' own rules (their datasets against each other: `data/mixture.py`, checked at preflight)."""
    if not data.sources:
        return []
    p = []
    if data.path:
        p.append(f"data.path and data.sources are both set: train on one directory (data.path = {data.path!r}) "
                 f"or on the mixture of {len(data.sources)} data.sources, not both")
    for i, src in enumerate(data.sources):
        at = f"data.sources[{i}]"
        if not src.path:
            p.append(f"{at}.path is empty: give the directory `pentatron tokenize` wrote")
        elif not src.path.startswith(PLACEHOLDER) and not Path(src.path).exists():
            p.append(f"{at}.path {src.path!r} does not exist (create it with `pentatron tokenize`)")
        if not src.weight > 0:  # weights are finite (the float check); 0 would be a source never read
            p.append(f"{at}.weight must be > 0 (a relative share of the samples), got {src.weight}; drop the "
                     "source instead of weighting it 0")
    labels = [s.label() for s in data.sources]
    for label in sorted({x for x in labels if labels.count(x) > 1}):
        at = ", ".join(f"data.sources[{i}]" for i, x in enumerate(labels) if x == label)
        p.append(f"{at} are all named {label!r}: give each a distinct `name`")
    return p


def fp8_problems(tr: TrainConfig, model: ModelConfig, layout: ParallelLayout) -> list[str]:
    """train.fp8's rules: every converted GEMM dimension (a rank's weight shard, a micro-batch's tokens)
    divisible by 16 (torch._scaled_mm's rule on CUDA). Any train.compile composes (parallel/compile.py)."""
    if tr.fp8 == "off":
        return [f"train.fp8_skip={tr.fp8_skip!r} is set but train.fp8 is off"] if tr.fp8_skip else []
    p = []
    align, tp = 16, max(layout.tp, 1)
    kv_local = (model.n_kv_heads // tp if model.n_kv_heads % tp == 0 else 1) * model.head_dim  # tp > kv: replicas
    dims = [("model.hidden_size", model.hidden_size, model.hidden_size),
            ("the attention width (n_heads × head_dim)", model.n_heads * model.head_dim,
             model.n_heads * model.head_dim // tp),
            ("the kv width (n_kv_heads × head_dim)", model.kv_dim, kv_local)]
    if model.moe is None or model.moe.first_dense_layers > 0:
        dims.append(("model.ffn_hidden_size", model.ffn_hidden_size, model.ffn_hidden_size // tp))
    for what, full, local in dims:
        if local % align:
            shard = f" per tp rank ({full} / tp={tp})" if local != full else ""
            p.append(f"train.fp8 needs every FP8 GEMM dimension divisible by {align}: {what} is {local}{shard}")
    linears = [f"layers.{i}.{m}" for i in range(model.n_layers)
               for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                         *(() if model.is_moe_layer(i) else ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")))]
    for pattern in tr.fp8_skip:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in linears):
            p.append(f"train.fp8_skip pattern {pattern!r} matches none of the FP8 layers (e.g. layers.0.attn.q_proj, "
                     "layers.*.mlp.down_proj)")
    tokens = tr.micro_batch * tr.seq_len // max(layout.cp, 1)
    if tokens % align:
        p.append(f"train.fp8 needs the tokens of a micro-batch per cp rank divisible by {align} (the weight "
                 f"gradient's GEMM dimension): train.micro_batch × train.seq_len / cp = {tokens}")
    return p


def eval_problems(ev: EvalConfig) -> list[str]:
    """[eval]'s own rules (its sizes against the data: `data/eval_split.py`, checked at preflight)."""
    p = []
    if ev.every < 0:
        p.append(f"eval.every must be ≥ 0 (0: no evaluation), got {ev.every}")
    if ev.batches < 1:
        p.append(f"eval.batches must be ≥ 1, got {ev.batches}")
    if not 0 <= ev.holdout < 1:
        p.append(f"eval.holdout must be within [0, 1) (a share of the training tokens), got {ev.holdout}")
    if ev.holdout_tokens < 0:
        p.append(f"eval.holdout_tokens must be ≥ 0, got {ev.holdout_tokens}")
    sources = [k for k, on in (("eval.holdout", ev.holdout > 0), ("eval.holdout_tokens", ev.holdout_tokens > 0),
                               ("eval.path", bool(ev.path))) if on]
    if len(sources) > 1:
        p.append(f"{' and '.join(sources)} are both set: validate on one source (a holdout of the training data, "
                 "or eval.path)")
    if ev.every > 0 and not sources:
        p.append(f"eval.every={ev.every} but no validation data: set eval.holdout (e.g. 0.01), eval.holdout_tokens "
                 "or eval.path")
    if ev.path and not ev.path.startswith(PLACEHOLDER) and not Path(ev.path).exists():
        p.append(f"eval.path {ev.path!r} does not exist (create it with `pentatron tokenize`)")
    return p


def profile_steps(spec: str) -> tuple[int, int] | None:
    """"a:b" → (a, b), the first and last step to profile; None when malformed."""
    parts = spec.split(":")
    if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
        return None
    a, b = int(parts[0]), int(parts[1])
    return (a, b) if 1 <= a <= b else None


def resolved_dp(cfg: Config, world_size: int) -> int:
    """The data-parallel degree once the world size is known (validated by `load_config`)."""
    return cfg.layout(world_size).dp


# "auto" compiles on CUDA only: fused elementwise kernels are torchtitan's default there; on CPU inductor
# measured no gain (BENCHMARKS.md, compile) and costs ~30 s on the first step.
COMPILE_AUTO_DEVICES = ("cuda",)


def compile_enabled(setting: bool | str, device_type: str) -> bool:
    """train.compile (true, false, "auto" or "try") on a device type: compile or not. The one rule, read by
    the trainer (parallel/compile.py) and the planner's default kernels (plan/recipes.py)."""
    if setting == "auto":
        return device_type in COMPILE_AUTO_DEVICES
    return setting is True or setting == "try"
