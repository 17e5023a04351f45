"""`pentatron generate CKPT --prompt TEXT`: text from a checkpoint written by `pentatron train`, in
one plain-PyTorch process (greedy, or top-k sampling).

A checkpoint whose ranks described their pieces is assembled by `checkpoint/export.load_full_model`
(any layout). Older ones are read here, from their keys: any dp / tp / pp layout with ZeRO-0, or
ZeRO-1/2/3 without tensor parallelism: pipeline ranks hold disjoint parameter names, a tensor-parallel shard is keyed
"<name>|tp<i>/<n>" (its split dimension is the one whose size differs from the full parameter's), and
a ZeRO shard "<key>[lo:hi]" is a range of the flattened parameter. The tokenizer is the training
dataset's (recorded by the run in `<checkpoint.dir>/run.json`), or `--tokenizer`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from pentatron.models.config import ModelConfig
from pentatron.observe.rundir import read_run_info

_RANGE = re.compile(r"(.*)\[(\d+):(\d+)\]")
_TP = re.compile(r"(.*)\|tp(\d+)/(\d+)")


class CheckpointError(ValueError):
    """A checkpoint or tokenizer that cannot be used (exit code 2)."""


def load_model(path: Path) -> tuple[torch.nn.Module, ModelConfig, Path]:
    """The trained model (fp32, CPU, eval mode), its config and the step directory it came from."""
    import torch.distributed.checkpoint as dcp

    from pentatron.checkpoint.safe_metadata import SafeReader, read_metadata
    from pentatron.checkpoint.verified import step_dir_of
    from pentatron.models.llama import build_model

    step_dir = step_dir_of(path)
    meta = json.loads((step_dir / "meta.json").read_text())
    model_cfg = ModelConfig.from_dict(meta["model"])
    model = build_model(model_cfg, device="cpu", dtype=torch.float32, init=False)  # every tensor is loaded
    stored = read_metadata(step_dir).state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()
             if k.startswith("model.") and hasattr(m, "size")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=SafeReader(step_dir), no_dist=True)
    full = assemble({k.removeprefix("model."): v for k, v in state.items()},
                    {n: p.shape for n, p in model.named_parameters()})
    missing = sorted(set(dict(model.named_parameters())) - set(full))
    if missing:
        raise CheckpointError(f"{step_dir} lacks parameters {missing[:4]}{' …' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full[name].to(p.dtype))
    return model.eval(), model_cfg, step_dir


def load_any_model(path: Path) -> tuple[torch.nn.Module, ModelConfig, Path]:
    """`load_model`, or for a checkpoint whose ranks described their pieces, the model assembled from
    them (any layout, ZeRO with tensor parallelism included)."""
    from pentatron.checkpoint.export import model_from_pieces
    from pentatron.checkpoint.reshard import has_pieces
    from pentatron.checkpoint.verified import refuse_nonfinite, verified_step_dir

    step_dir = verified_step_dir(path)  # every file against the manifest, meta.json checked
    if has_pieces(step_dir):
        model, model_cfg = model_from_pieces(step_dir)
    else:
        model, model_cfg, _ = load_model(step_dir)
    refuse_nonfinite(step_dir, model.named_parameters(), "nothing is generated or exported from it")
    return model, model_cfg, step_dir


def assemble(pieces: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Whole parameters from a checkpoint's keys (see the module docstring)."""
    ranges: dict[str, list[tuple[int, torch.Tensor]]] = {}
    whole: dict[str, torch.Tensor] = {}
    for key, t in pieces.items():
        m = _RANGE.fullmatch(key)
        if m:
            ranges.setdefault(m.group(1), []).append((int(m.group(2)), t.flatten()))
        else:
            whole[key] = t
    for key, parts in ranges.items():  # ZeRO: the ranges of one flattened tensor, in order
        flat = torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])])
        name = _TP.fullmatch(key)
        if name is not None:
            raise CheckpointError(f"{key}: checkpoints with ZeRO and tensor parallelism together cannot be "
                                  "read by `pentatron generate` yet; train with parallel.zero=0 or tp=1")
        if key not in shapes or flat.numel() != shapes[key].numel():
            continue  # not a model parameter (or padding beyond it)
        whole[key] = flat.view(shapes[key])
    shards: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, t in whole.items():
        m = _TP.fullmatch(key)
        if m:
            shards.setdefault(m.group(1), {})[int(m.group(2))] = t
        elif key in shapes:
            out[key] = t
    for name, by_index in shards.items():
        if name not in shapes:
            continue
        parts = [by_index[i] for i in sorted(by_index)]
        dims = [d for d, (a, b) in enumerate(zip(parts[0].shape, shapes[name], strict=True)) if a != b]
        out[name] = torch.cat(parts, dim=dims[0]) if dims else parts[0]
        if out[name].shape != shapes[name]:
            raise CheckpointError(f"{name}: tensor-parallel shards of shape {tuple(parts[0].shape)} do not "
                                  f"make up the parameter's shape {tuple(shapes[name])}")
    return out


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, top_k: int,
             temperature: float, max_seq_len: int, eos_id: int | None, seed: int) -> list[int]:
    """Greedy decoding (top_k = 1) or sampling among the top_k most likely tokens; no KV cache (the
    whole context is re-run each step: plain and exact, fine for short samples)."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-max_seq_len:]])
        logits = model(context)[0, -1].float()
        if top_k <= 1:
            nxt = int(logits.argmax())
        else:
            values, indices = logits.topk(min(top_k, logits.numel()))
            probs = torch.softmax(values / temperature, dim=-1)
            nxt = int(indices[torch.multinomial(probs, 1, generator=generator)])
        if eos_id is not None and nxt == eos_id:
            break
        ids.append(nxt)
    return ids[len(prompt_ids):]


def tokenizer_source(step_dir: Path, override: Path | None) -> tuple[Path, int | None]:
    """(the tokenizer.json a checkpoint's model was trained with, its end-of-document id when the dataset's
    index.json says it): `override` (a dataset directory or a tokenizer.json), else the training dataset
    named by the run.json beside the checkpoint. Raises CheckpointError naming what to pass."""
    if override is not None:
        dataset = override if override.is_dir() else override.parent
        path = override / "tokenizer.json" if override.is_dir() else override
    else:
        info = read_run_info(step_dir.parent) or {}
        if not info.get("dataset"):
            raise CheckpointError(f"no run.json next to {step_dir} names the training dataset; pass --tokenizer "
                                  "DATASET_DIR (or its tokenizer.json)")
        dataset = Path(info["dataset"])
        path = dataset / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"tokenizer {path} does not exist; pass --tokenizer DATASET_DIR")
    try:
        eos = int(json.loads((dataset / "index.json").read_text())["eos_id"])
    except (OSError, ValueError, KeyError, TypeError):
        eos = None
    return path, eos


def _tokenizer_for(step_dir: Path, override: Path | None) -> tuple[Any, int | None]:
    from tokenizers import Tokenizer

    path, eos = tokenizer_source(step_dir, override)
    try:
        return Tokenizer.from_file(str(path)), eos
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own untyped exception
        raise CheckpointError(f"tokenizer {path} is not a tokenizer.json `pentatron tokenize` wrote "
                              f"({str(e).splitlines()[0][:120]}); pass --tokenizer DATASET_DIR") from None


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from a training checkpoint",
        description="Continue a prompt with a model trained by `pentatron train` (checkpoint.dir set). "
                    "Greedy by default; --top-k K samples among the K most likely tokens.")
    p.add_argument("checkpoint", type=Path, help="checkpoint.dir of the run (or one step_XXXXXXXX in it)")
    p.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top-k", type=int, default=1, help="1: greedy (default); K > 1: sample among the top K")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="dataset directory or tokenizer.json (default: the training run's dataset)")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    problems = [f"{name} must be > 0, got {v}" for name, v in
                (("--max-new-tokens", args.max_new_tokens), ("--top-k", args.top_k),
                 ("--temperature", args.temperature)) if v <= 0]
    if problems:
        print("pentatron: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    from pentatron.checkpoint.errors import CheckpointError as StoreError

    try:
        model, model_cfg, step_dir = load_any_model(args.checkpoint)
        tokenizer, eos = _tokenizer_for(step_dir, args.tokenizer)
    except (CheckpointError, StoreError) as e:
        print(f"pentatron: error: {e}", file=sys.stderr)
        return 2
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        print("pentatron: error: --prompt encodes to no tokens; give some text", file=sys.stderr)
        return 2
    if max(prompt_ids) >= model_cfg.vocab_size:
        print(f"pentatron: error: the tokenizer gives ids ≥ model.vocab_size={model_cfg.vocab_size}; pass the "
              "--tokenizer the model was trained with", file=sys.stderr)
        return 2
    new = generate(model, prompt_ids, args.max_new_tokens, args.top_k, args.temperature, model_cfg.max_seq_len,
                   eos, args.seed)
    mode = "greedy" if args.top_k == 1 else f"top-{args.top_k} sampling, temperature {args.temperature}"
    print(f"pentatron: {len(new)} tokens from {step_dir} ({mode}):", file=sys.stderr)
    print(args.prompt + tokenizer.decode(new))
    return 0
