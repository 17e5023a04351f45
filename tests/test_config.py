import pytest

from pentatron.config import ConfigError, load_config, parse_override


def _problems(tmp_path, toml: str = "", overrides=(), world_size=None) -> list[str]:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides), world_size=world_size)
    return e.value.problems


def test_defaults_and_registry_model_load(tmp_path):
    (tmp_path / "c.toml").write_text('[model]\nname = "debug"\nn_layers = 2\n[train]\nsteps = 3\nwarmup = 1\n')
    cfg = load_config(tmp_path / "c.toml", ["train.lr=1e-4", "parallel.zero=1"], world_size=1)
    assert cfg.train.steps == 3 and cfg.train.lr == 1e-4 and cfg.parallel.zero == 1
    assert cfg.model_config().n_layers == 2 and cfg.model_config().hidden_size == 128


def test_int_is_accepted_for_float_fields(tmp_path):
    (tmp_path / "c.toml").write_text("[train]\nlr = 1\n")
    assert load_config(tmp_path / "c.toml").train.lr == 1.0


@pytest.mark.parametrize(("toml", "overrides", "world", "expected"), [
    ("[trian]\nsteps = 1", (), None, "unknown section [trian] (did you mean [train]?)"),
    ("[train]\nstep = 1", (), None, "unknown key train.step (did you mean train.steps?)"),
    ("[train]\nsteps = 'ten'", (), None, "train.steps must be an integer, got 'ten'"),
    ("[train]\nlr = 0", (), None, "train.lr must be > 0, got 0.0"),
    ("[train]\nlr = -1e-3", (), None, "train.lr must be > 0"),
    ("[train]\nseq_len = 4096", (), None, "train.seq_len=4096 is longer than the model's max_seq_len=512"),
    ("[train]\nglobal_batch = 10\nmicro_batch = 4", (), None,
     "train.global_batch=10 is not divisible by train.micro_batch=4 × dp=1"),
    ("[train]\nglobal_batch = 8\nmicro_batch = 4", (), 4,
     "train.global_batch=8 is not divisible by train.micro_batch=4 × dp=4"),
    ("[parallel]\nzero = 4", (), None, "parallel.zero must be 0, 1, 2 or 3, got 4"),
    ("[parallel]\ndp = 3", (), 4, "parallel.dp×tp×pp×cp = 3×1×1×1 = 3 does not equal the world size 4"),
    ("[train]\nprecision = 'fp8'", (), None, "train.precision must be one of 'auto', 'fp32', 'bf16'"),
    ("[train]\nrecompute = 'some'", (), None, "train.recompute must be one of 'none', 'selective', 'full'"),
    ("[train]\nwarmup = 50\nsteps = 10", (), None, "train.warmup=50 is longer than train.steps=10"),
    ("[train]\nclip = -1.0", (), None, "train.clip must be ≥ 0"),
    ("[train]\nbeta2 = 1.0", (), None, "train.beta2 must be within [0, 1)"),
    ("[model]\nname = 'gpt5'", (), None, "model.name: unknown model 'gpt5'"),
    ("[model]\nn_heads = 3", (), None, "model.n_heads=3 does not divide model.hidden_size=128"),
    ("[model]\nn_kv_heads = 3", (), None, "model.n_kv_heads=3 does not divide model.n_heads=4"),
    ("[data]\npath = '/no/such/dir'", (), None, "data.path '/no/such/dir' does not exist"),
    ("[log]\ntensorboard = 'yes'", (), None, "log.tensorboard must be true or false, got 'yes'"),
    ("", ("train.steps=0",), None, "train.steps must be > 0, got 0"),
    ("[train]\nmicro_batch = 0", (), None, "train.micro_batch must be an integer ≥ 1, got 0"),
    # context parallelism: the sequence and the heads it splits
    ("[parallel]\ncp = 2\n[train]\nseq_len = 62", (), 2,
     "parallel.cp=2 (ring) needs train.seq_len=62 divisible by 2·cp = 4"),
    ("[parallel]\ncp = 4\ncp_mode = 'ulysses'\ntp = 2\n", (), 8,
     "Ulysses over 4 ranks needs the attention heads per tp rank (model.n_heads / tp = 4/2 = 2) divisible by 4"),
    ("[parallel]\ncp = 4\ncp_mode = 'hybrid'\ncp_ulysses = 3", (), 4,
     "parallel.cp_mode='hybrid' needs parallel.cp_ulysses to divide parallel.cp=4"),
    ("[parallel]\ncp = 2\ncp_ulysses = 2", (), 2, "parallel.cp_ulysses=2 is only used with parallel.cp_mode='hybrid'"),
    ("[parallel]\ncp = 2\ncp_mode = 'tree'", (), 2, "parallel.cp_mode must be one of 'ring', 'ulysses', 'hybrid'"),
    ("[parallel]\ncp = 2\ntp = 4\nsp = true\n[train]\nseq_len = 36", (), 8,
     "parallel.sp=true needs the tokens per cp rank (train.seq_len / cp = 36/2 = 18) to be divisible by parallel.tp=4"),
    # HSDP: a shard degree dividing dp, for a ZeRO stage, over dp alone
    ("[parallel]\nzero = 3\ndp_shard = 3", (), 4, "parallel.dp_shard=3 must divide parallel.dp=4"),
    ("[parallel]\ndp_shard = 2", (), 4, "parallel.dp_shard=2 < dp=4 (HSDP) needs parallel.zero=1, 2 or 3"),
    ("[parallel]\nzero = 3\ndp_shard = 8", (), 4, "parallel.dp_shard=8 must divide parallel.dp=4"),
    ("[parallel]\nzero = 3\ndp_shard = -1", (), 4, "parallel.dp_shard must be an integer ≥ 0"),
    ("[parallel]\nzero = 3\ndp_shard = 1\ncp = 2", (), 4, "(HSDP) is not supported with parallel.cp=2"),
    # an explicit pipeline split (the debug model has 4 layers; global batch 8 of 2 → 4 micro-batches)
    ("[parallel]\npp = 2\npp_layers = 3\n[train]\nmicro_batch = 2", (), 2, "parallel.pp_layers must be a list, got 3"),
    ("[parallel]\npp = 2\npp_layers = [1, 'x']", (), 2, "parallel.pp_layers[1] must be an integer, got 'x'"),
    ("[parallel]\npp = 2\npp_layers = [1, 2]\n[train]\nmicro_batch = 2", (), 2,
     "parallel.pp_layers=[1, 2] sums to 3, but the model has 4 layers"),
    ("[parallel]\npp = 2\npp_layers = [0, 4]\n[train]\nmicro_batch = 2", (), 2,
     "parallel.pp_layers entries must be integers ≥ 1, got [0, 4]"),
    ("[parallel]\npp = 2\npp_layers = [1, 1, 2]\n[train]\nmicro_batch = 2", (), 2,
     "parallel.pp_layers lists 3 stages but there are 2 pipeline stages (pp=2)"),
    ("[parallel]\npp_layers = [4]", (), 1, "parallel.pp_layers=[4] needs parallel.pp > 1"),
    # train.fp8: the recipes, GEMM dimensions (a tp shard's, a micro-batch's tokens), skip patterns
    ("[train]\nfp8 = 'blockwise'", (), None, "train.fp8 must be one of 'off', 'tensorwise', 'rowwise'"),
    ("[train]\nfp8 = 'tensorwise'\n[model]\nhidden_size = 96\n[parallel]\ntp = 2", (), 2,
     "train.fp8 needs every FP8 GEMM dimension divisible by 16: the kv width (n_kv_heads × head_dim) is 24 per "
     "tp rank (48 / tp=2)"),
    ("[train]\nfp8 = 'tensorwise'\n[model]\nhidden_size = 72\nn_heads = 4\nn_kv_heads = 4", (), None,
     "train.fp8 needs every FP8 GEMM dimension divisible by 16: model.hidden_size is 72"),
    ("[train]\nfp8 = 'tensorwise'\nffn_hidden_size = 1", (), None, "unknown key train.ffn_hidden_size"),
    ("[train]\nfp8 = 'tensorwise'\n[model]\nffn_hidden_size = 200\n[parallel]\ntp = 2", (), 2,
     "model.ffn_hidden_size is 100 per tp rank (200 / tp=2)"),
    ("[train]\nfp8 = 'tensorwise'\nmicro_batch = 1\nseq_len = 24", (), None,
     "train.micro_batch × train.seq_len / cp = 24"),
    ("[train]\nfp8 = 'tensorwise'\nfp8_skip = ['layers.9.*']", (), None,
     "train.fp8_skip pattern 'layers.9.*' matches none of the FP8 layers"),
    ("[train]\nfp8_skip = ['layers.0.*']", (), None, "train.fp8_skip=['layers.0.*'] is set but train.fp8 is off"),
    # --resume-from without a directory to resume from (trained from scratch, silently)
    ("", ("checkpoint.resume_from='4'",), None, "checkpoint.resume_from='4' (--resume-from) needs checkpoint.dir"),
])
def test_each_bad_value_gets_a_message_naming_the_field(tmp_path, toml, overrides, world, expected):
    problems = _problems(tmp_path, toml, overrides, world)
    assert any(expected in p for p in problems), problems


# Each was a traceback, a "Lower train.lr" stop many seconds later, or a run that trained nothing (exit 0):
# `x <= 0` is false for NaN. Every float field of every section is checked finite by its type.
@pytest.mark.parametrize("compile_", ["true", "'try'", "'auto'", "false"])
def test_fp8_composes_with_every_compile_setting(tmp_path, compile_):
    """train.fp8's linears compile inside their blocks (parallel/compile.py): no train.compile value is refused."""
    (tmp_path / "c.toml").write_text(f"[train]\nfp8 = 'rowwise'\ncompile = {compile_}\n")
    cfg = load_config(tmp_path / "c.toml", [], world_size=1)
    assert cfg.train.fp8 == "rowwise" and str(cfg.train.compile).lower() == compile_.strip("'")


@pytest.mark.parametrize(("override", "expected"), [
    ("train.lr=nan", "train.lr must be a finite number, got nan"),
    ("train.lr=inf", "train.lr must be a finite number, got inf"),
    ("train.lr=1e999", "train.lr must be a finite number, got inf"),
    ("train.lr=1" + "0" * 320, "train.lr must be a finite number, got an integer of 321 digits"),
    ("parallel.bucket_mb=nan", "parallel.bucket_mb must be a finite number, got nan"),
    ("train.clip=nan", "train.clip must be a finite number"),
    ("train.weight_decay=nan", "train.weight_decay must be a finite number"),
    ("train.eps=inf", "train.eps must be a finite number, got inf"),
    ("train.beta1=nan", "train.beta1 must be a finite number"),
    ("train.min_lr_ratio=nan", "train.min_lr_ratio must be a finite number"),
    ("train.peak_tflops=-inf", "train.peak_tflops must be a finite number, got -inf"),
    ("model.rope_theta=nan", "model.rope_theta must be a finite number"),
    ("model.init_std=nan", "model.init_std must be a finite number"),
    ("moe.route_scale=nan", "moe.route_scale must be a finite number"),
    ("distributed.timeout_s=nan", "distributed.timeout_s must be a finite number"),
    ("distributed.timeout_s=1e300", "distributed.timeout_s must be > 0 and ≤ 1e+09, got 1e+300"),
    ("train.seed=18446744073709551616", "train.seed must be ≥ -2**63 and ≤ 2**63-1, got 18446744073709551616"),
    ("train.seed=-1", "train.seed must be ≥ 0 and ≤ 2**63-1, got -1"),
    ("train.steps=9223372036854775808", "train.steps must be ≥ -2**63 and ≤ 2**63-1"),
])
def test_every_number_is_finite_and_in_range(tmp_path, override, expected):
    problems = _problems(tmp_path, overrides=[override])
    assert problems == [expected] or any(expected in p for p in problems), problems


def test_the_largest_seed_is_accepted(tmp_path):
    (tmp_path / "c.toml").write_text("")
    assert load_config(tmp_path / "c.toml", [f"train.seed={2**63 - 1}"]).train.seed == 2**63 - 1


def test_model_shapes_refuse_nan_whoever_reads_them():
    """A model file (`plan --model-file`) builds a ModelConfig without the config loader's typed check."""
    import dataclasses

    from pentatron.models.registry import get_model_config

    cfg = get_model_config("debug")
    for name in ("rope_theta", "norm_eps", "init_std"):
        assert dataclasses.replace(cfg, **{name: float("nan")}).problems() == [
            f"model.{name} must be a finite number, got nan"]


def test_an_explicit_pipeline_split_reaches_the_layout(tmp_path):
    (tmp_path / "c.toml").write_text("[parallel]\npp = 2\npp_schedule = 'interleaved'\npp_virtual = 2\n"
                                     "pp_layers = [1, 2, 2, 1]\n[model]\nn_layers = 6\n[train]\nmicro_batch = 2\n")
    cfg = load_config(tmp_path / "c.toml", world_size=2)
    assert cfg.parallel.pp_layers == [1, 2, 2, 1] and cfg.layout(2).pp_layers == (1, 2, 2, 1)
    # interleaving without an explicit split still needs equal chunks
    assert any("interleaved chunks must hold equal numbers of layers" in p for p in
               _problems(tmp_path, "[parallel]\npp = 2\npp_schedule = 'interleaved'\npp_virtual = 2\n"
                                   "[model]\nn_layers = 6\n[train]\nmicro_batch = 2\n", world_size=2))


def test_all_problems_are_reported_at_once(tmp_path):
    problems = _problems(tmp_path, "[train]\nlr = 0\nsteps = 0\nclip = -1.0\n[parallel]\nzero = 9\n")
    assert len(problems) == 4, problems


def test_unimplemented_dimension_is_a_clear_error(tmp_path):
    problems = _problems(tmp_path, "[parallel]\nep = 2", world_size=2)
    assert any("parallel.ep=2" in p for p in problems)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_override_parsing():
    assert parse_override("train.lr=1e-3") == (["train", "lr"], 1e-3)
    assert parse_override("--train.steps=5") == (["train", "steps"], 5)
    assert parse_override("log.dir=runs/x") == (["log", "dir"], "runs/x")
    assert parse_override("parallel.sp=true") == (["parallel", "sp"], True)
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("train.lr")
    with pytest.raises(ConfigError, match="section.key"):
        parse_override("lr=3")


def test_qwen3_fields_override_and_resolve():
    """[model] qk_norm / attn_head_dim make any shape Qwen3-like; the resolved config keeps them."""
    cfg = load_config(None, ["model.qk_norm=true", "model.attn_head_dim=48"])
    m = cfg.model_config()
    assert (m.qk_norm, m.head_dim, m.name) == (True, 48, "debug")
    assert load_config(None, ["model.name='qwen3-8b'"]).model_config().qk_norm
    resolved = cfg.resolved_dict(1)["model"]
    assert (resolved["qk_norm"], resolved["attn_head_dim"]) == (True, 48)
    assert "moe" not in cfg.resolved_dict(1)  # a dense model's config.json has no [moe] of nulls
    moe = load_config(None, ["model.name='debug-moe'"]).resolved_dict(1)["moe"]
    assert (moe["n_experts"], moe["top_k"], moe["capacity_factor"]) == (8, 2, None)  # None: dropless
    with pytest.raises(ConfigError, match="attn_head_dim"):
        load_config(None, ["model.attn_head_dim=47"])
