"""Checks of everything a user can fix — device, data, checkpoint, log directory, launch environment —
made before any worker or process group starts, so that each problem is reported once, with exit
code 2 and no traceback, whether the run was started by `pentatron train --nproc N`, an outer torchrun
or srun. (The config itself is validated earlier, by `config.load_config`.)

Every check is a pure function of the config, the files and the host, so every rank reaches the same
verdict; `distributed/launch.agree_on_preflight` still pools the ranks' findings through the
rendezvous store, for the problems that only some hosts see (a file missing on one node).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.lineage import fresh_run_problem, resume_options
from pentatron.checkpoint.resume import candidates, model_mismatch
from pentatron.config import Config, resolved_dp
from pentatron.data.errors import DataError


def preflight_problems(cfg: Config, *, world_size: int, build_default_data: bool,
                       local_ranks: int | None = None) -> list[str]:
    """Every user-fixable problem found on this host (empty: go). `build_default_data` tokenizes the
    built-in corpus if it is not cached yet (the launcher or rank 0 does it, once). `local_ranks`: the
    ranks on this host (default: LOCAL_WORLD_SIZE, else all)."""
    from pentatron.preflight_memory import local_rank_count, memory_problems

    problems = device_problems(cfg) + environment_problems()
    if not problems:
        problems += memory_problems(cfg, world_size, local_ranks or local_rank_count(world_size))
    problems += data_problems(cfg, build_default_data)
    problems += checkpoint_problems(cfg, world_size)
    problems += log_problems(cfg)
    return problems


def device_problems(cfg: Config) -> list[str]:
    kind = cfg.train.device
    if kind == "cuda" and not torch.cuda.is_available():
        return ["train.device='cuda' but this host has no usable CUDA device (torch.cuda.is_available() is "
                f"False, torch {torch.__version__}); use train.device=cpu (or auto)"]
    if kind != "cpu" and torch.cuda.is_available():
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpus = torch.cuda.device_count()
        if local_ranks > gpus:
            return [f"{local_ranks} processes on this host but only {gpus} CUDA device(s): NCCL needs one GPU "
                    "per process; launch at most that many per node"]
        if cfg.train.fp8 != "off" and torch.cuda.get_device_capability() < FP8_CAPABILITY:
            major, minor = torch.cuda.get_device_capability()
            return [f"train.fp8={cfg.train.fp8!r} needs FP8 tensor cores (compute capability ≥ 8.9: Ada, Hopper, "
                    f"Blackwell); {torch.cuda.get_device_name()} is sm_{major}{minor}: set train.fp8=off"]
    return []


FP8_CAPABILITY = (8, 9)  # torch._scaled_mm's FP8 kernels: Ada (8.9) and later


def environment_problems() -> list[str]:
    """A launch environment that cannot form a process group (checked before anyone waits on it)."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return []
    if "SLURM_PROCID" in env:
        how = ('in the job script, export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) '
               "and MASTER_PORT=<a free port> before srun (README: Beyond one machine)")
    else:
        how = "start the ranks with torchrun or srun (or set MASTER_ADDR, MASTER_PORT and RANK yourself)"
    p = [f"{name} is not set, but WORLD_SIZE={env['WORLD_SIZE']} is: {how}"
         for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in env]
    if not p and not env["MASTER_PORT"].isdigit():
        p.append(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number")
    return p


def data_problems(cfg: Config, build_default_data: bool) -> list[str]:
    from pentatron.data.eval_split import mixture_eval_problems
    from pentatron.data.loader import TokenDataset, too_short_problem
    from pentatron.data.mixture import mixture_problems
    from pentatron.train.trainer import resolve_dataset

    if not cfg.data.path and not cfg.data.sources and not build_default_data:
        return []  # the built-in corpus is prepared (and checked) by rank 0
    vocab = cfg.model_config().vocab_size
    names = [s.label() for s in cfg.data.sources] or [""]
    try:
        datasets = ([TokenDataset(Path(s.path)) for s in cfg.data.sources] if cfg.data.sources
                    else [TokenDataset(resolve_dataset(cfg, vocab))])
        for ds in datasets:
            ds.check_vocab(vocab)
    except DataError as e:
        return [str(e)]
    if len(datasets) > 1 and (mixed := mixture_problems(datasets, names)):
        return mixed
    if short := [p for ds in datasets if (p := too_short_problem(ds, cfg.train.seq_len))]:
        return short
    held = mixture_eval_problems(cfg.eval, datasets, names, cfg.train.seq_len, cfg.train.global_batch, vocab)
    if held:
        return held
    if build_default_data:  # the launcher or rank 0 reads every token id once (data/vocab_check.py)
        from pentatron.data.vocab_check import scan_problem

        return [found for ds in datasets if (found := scan_problem(ds.path, ds.index, vocab))]
    return []


def checkpoint_problems(cfg: Config, world_size: int) -> list[str]:
    """A checkpoint directory that cannot be written, or a `latest` that cannot be resumed."""
    ck = cfg.checkpoint
    if not ck.dir:
        return []
    root = Path(ck.dir)
    if root.exists() and not root.is_dir():
        return [f"checkpoint.dir {ck.dir!r} is a file, not a directory"]
    space = storage_problems(cfg, root)
    pointer = root / "latest"
    if not ck.resume and (pointer.exists() or pointer.is_symlink()) and not pointer.is_file():
        return space + [f"{pointer}: is not the `latest` pointer file (a directory or a dangling link?), so no "
                        "save could be published; move it away"]
    if not ck.resume:
        found = None if ck.force_new else fresh_run_problem(root)
        return space + ([found] if found else [])
    try:  # the same choice the ranks make (resume.candidates): never a guess
        paths = candidates(root, ck.resume_from, ck.fallback)
    except CheckpointError as e:
        return space + [str(e)]
    if not paths:
        return space
    target = paths[0]
    meta_path = target / "meta.json"
    fix = "start a new run beside it with --force-new, or use another checkpoint.dir"
    if not meta_path.is_file():
        if ck.fallback:
            return space  # the ranks skip it and resume the newest older checkpoint that verifies
        return [f"{root / 'latest'} names {target}, which is not a complete checkpoint; {resume_options(root)}"]
    try:
        meta = json.loads(meta_path.read_text())
        saved = meta.get("layout", {"zero": 0})
        model = meta.get("model", {})
    except (OSError, ValueError, AttributeError) as e:
        return [f"{meta_path} is unreadable ({e}); {fix}"]
    problems = space
    par = cfg.parallel
    layout = [("tp", par.tp), ("pp", par.pp), ("zero", par.zero)]
    if saved.get("zero", 0) > 0:  # ZeRO shards are cut by dp (replicated state is not)
        layout.append(("dp", resolved_dp(cfg, world_size)))
    if (target / "pieces").is_dir():
        layout = []  # saved with its pieces described: any layout can re-shard it (checkpoint/reshard.py)
    for key, mine in layout:
        if key in saved and saved[key] != mine:
            problems.append(f"checkpoint {target} was written with parallel.{key}={saved[key]}, this run has "
                            f"parallel.{key}={mine}, and it was saved before checkpoints described their pieces, so it "
                            f"cannot be re-sharded: set parallel.{key}={saved[key]}, or {fix}")
    mismatch = model_mismatch(target, {"model": model}, cfg.model_config().to_dict())  # shapes, not names
    if mismatch:
        problems.append(mismatch)
    return problems


def convert_problems(cfg: Config, src: Path, world_size: int, rank: int) -> list[str]:
    """`checkpoint convert`: the device, SRC holding a checkpoint (a checkpoint.dir with `latest`, or one step
    directory) that no running job is writing (rank 0 looks), and checkpoint.dir (the destination) new,
    writable and with room."""
    from pentatron.checkpoint.lineage import latest_name
    from pentatron.checkpoint.lock import LOCK_NAME, probe
    from pentatron.checkpoint.space import PROBE_PREFIX

    dst = Path(cfg.checkpoint.dir)
    problems = device_problems(cfg)
    if not src.is_dir():
        problems.append(f"{src}: no such checkpoint directory")
    elif not (src / "meta.json").is_file() and latest_name(src) is None:
        problems.append(f"{src}: holds no checkpoint (neither a `latest` pointer nor a step directory's meta.json)")
    elif src.resolve() == dst.resolve() or src.resolve() in dst.resolve().parents:
        problems.append(f"the destination {dst} must be a new directory outside {src}")
    elif rank == 0:
        found = probe(src)
        problems += [f"{found} (the source of the conversion)"] if found else []
    if fresh_run_problem(dst) is not None:  # the same test as a fresh run's, another remedy
        problems.append(f"the destination {dst} already holds checkpoints; give a new (or empty) directory")
    elif dst.exists() and not dst.is_dir():
        problems.append(f"the destination {dst} is a file, not a directory")
    # not content: this job's lock (rank 0 takes it before the others look) and another rank's writability probe
    elif dst.is_dir() and any(p.name != LOCK_NAME and not p.name.startswith(PROBE_PREFIX) for p in dst.iterdir()):
        problems.append(f"the destination {dst} is not empty; give a new (or empty) directory")
    else:
        problems += storage_problems(cfg, dst)
    return problems


def storage_problems(cfg: Config, root: Path) -> list[str]:
    """checkpoint.dir writable, with room for (keep + 1) checkpoints of the predicted size — the ones
    a resume continues count as already paid for."""
    from pentatron.checkpoint.lineage import complete_checkpoints, latest_name, read_meta
    from pentatron.checkpoint.space import directory_problems, predicted_checkpoint_bytes
    from pentatron.distributed.launch import local_device
    from pentatron.precision import resolve_precision

    dtype = resolve_precision(cfg.train.precision, local_device(cfg.train.device)).param_dtype
    size = predicted_checkpoint_bytes(cfg.model_config().num_params(), dtype)
    slots = cfg.checkpoint.keep + 1
    name = latest_name(root) if cfg.checkpoint.resume and root.is_dir() else None
    meta = read_meta(root / name) if name else None
    if meta and isinstance(meta.get("run_id"), str):
        kept = sum(c.run_id == meta["run_id"] for c in complete_checkpoints(root))
        slots -= min(kept, cfg.checkpoint.keep)
    return directory_problems(root, cfg.checkpoint.keep, size, slots)


LOG_SPACE_BYTES = 64 << 20  # a run's metrics, TensorBoard events, flight dumps and profiles


def log_problems(cfg: Config) -> list[str]:
    """log.dir a directory (or creatable), writable, with room for a run's logs; W&B installed if asked for."""
    import shutil

    from pentatron.checkpoint.space import existing_ancestor, writable_problem
    from pentatron.observe.wandb_log import wandb_problem

    if problem := wandb_problem(cfg.log.wandb):
        return [problem]
    path = Path(cfg.log.dir)
    if path.exists() and not path.is_dir():
        return [f"log.dir {cfg.log.dir!r} is a file, not a directory"]
    problem = writable_problem(path, "log.dir")
    if problem:
        return [problem]
    free = shutil.disk_usage(path if path.is_dir() else existing_ancestor(path)).free
    if free < LOG_SPACE_BYTES:
        return [f"log.dir {cfg.log.dir!r} has {free / 2**20:.1f} MiB free, a run's logs need ≈ "
                f"{LOG_SPACE_BYTES >> 20} MiB; free space or choose another log.dir"]
    return []
