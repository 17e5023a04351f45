"""The README's tour, replayed: every command of its first ```bash block under "A short tour" runs (with
small sizes), then every command of the fine-tuning walkthrough's block (as written: its config is already
small) on a tiny random Qwen3 built here with `transformers`, so the README cannot drift from the code. And
`pentatron demo` (what `make demo` runs), shortened.

A tour command that starts processes (`--nproc`, torchrun) runs as a subprocess, as the user types it; the
others call the CLI's `main` in this process (tests/launchers.in_process: the same code, without ~3 s of a
fresh interpreter importing torch for each)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from tests.launchers import PY, ROOT, _env, in_process
from tests.reference_loop import EXACT_RTOL, FP64

SMALL = ["--set=train.steps=2", "--set=train.warmup=1", "--set=log.progress=false"]


WALKTHROUGH = "### Fine-tuning a Hugging Face model"


def _commands(heading: str) -> list[str]:
    """The lines of the first ```bash block after `heading`."""
    text = (ROOT / "README.md").read_text()
    assert heading in text, f"README: no {heading!r}"
    block = re.search(r"```bash\n(.*?)```", text[text.index(heading):], re.S)
    assert block is not None, f"README: no ```bash block under {heading!r}"
    return [line for line in block.group(1).splitlines() if line.strip()]


def tour_commands() -> list[str]:
    return _commands("## A short tour")


def _argv(line: str, dataset: Path, hf_dir: Path, small: bool = True) -> list[str]:
    """The command's words after the program (`pentatron` or `torchrun`); `small`: sized down."""
    words = shlex.split(line, comments=True)
    assert words[0] in ("pentatron", "torchrun"), f"README tour command must start with pentatron or torchrun: {line}"
    argv = [w.replace("path/to/hf_qwen3", str(hf_dir)) for w in words[1:]]
    if "train" in words and small:
        argv += SMALL
        if not any(w.startswith("data.path=") for w in words):
            argv.append(f"--set=data.path={json.dumps(str(dataset))}")
    return argv


def _run(line: str, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """Exit code, stdout and all output: processes are started as the user starts them, the rest runs here."""
    if line.startswith("torchrun") or "--nproc" in line:
        program = [PY, "-m", "torch.distributed.run"] if line.startswith("torchrun") else [PY, "-m", "pentatron.cli"]
        done = subprocess.run(program + argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=400)
        return done.returncode, done.stdout, done.stdout + done.stderr
    outcome = in_process(argv, cwd)
    return outcome.codes[0], outcome.stdout, outcome.output


def _workdir(tmp: Path) -> None:
    """What the tour assumes: the repository's configs, two directories of text files."""
    (tmp / "configs").symlink_to(ROOT / "configs")
    corpus, notes = tmp / "my_corpus", tmp / "my_notes"
    corpus.mkdir()
    notes.mkdir()
    for f in sorted((ROOT / "src" / "pentatron").rglob("*.py"))[:25]:
        shutil.copy(f, corpus / f"{f.parent.name}_{f.name}.txt")
    for f in sorted((ROOT / "docs").glob("*.md"))[:4]:
        shutil.copy(f, notes / f.name)


def _hf_qwen3(out: Path) -> None:
    """A tiny random Qwen3 (q/k norms, head_dim 24 ≠ 64 / 4 heads, tied) saved as Hugging Face saves one; its
    vocabulary is the tour tokenizer's (4096)."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)


def _check(line: str, out: str) -> None:
    """What each kind of README command must print besides exiting 0."""
    words = line.split()
    if " train " in f" {line} " and "torchrun" not in line:
        assert "run summary" in out, line
    if words[1] == "tokenize":
        assert "train on it:" in out and "model.vocab_size" in out
    if words[1:3] == ["convert", "verify"]:
        assert "PASS" in out, out


def test_every_readme_tour_command_runs(tmp_path, default_dataset):
    _workdir(tmp_path)
    hf_dir = tmp_path / "hf_qwen3"
    _hf_qwen3(hf_dir)
    commands = tour_commands()
    assert len(commands) >= 6
    for line in commands:
        code, out, everything = _run(line, _argv(line, default_dataset, hf_dir), tmp_path)
        assert code == 0, f"README command failed: {line}\n{everything[-3000:]}"
        _check(line, out)
    # The walkthrough, on the tour's data/my_corpus: import → 2 ranks (dp2) on the mixture with validation → resume
    # in tp2 + sp → export → transformers' logits against ours
    walk = _commands(WALKTHROUGH)
    assert [w.split()[1:3] for w in walk] == [["checkpoint", "import-hf"], ["tokenize", "my_notes/"],
                                              ["train", "configs/finetune.toml"], ["train", "configs/finetune.toml"],
                                              ["checkpoint", "export-hf"], ["convert", "verify"]], walk
    outs = []
    for line in walk:
        code, out, everything = _run(line, _argv(line, default_dataset, hf_dir, small=False), tmp_path)
        assert code == 0, f"README walkthrough command failed: {line}\n{everything[-3000:]}"
        _check(line, out)
        outs.append(out)
    first, resumed = outs[2], outs[3]
    for out in (first, resumed):  # the mixture's per-source tokens and the validation loss, per source too
        assert re.search(r"validation   loss final \S+ \(perplexity", out), out[-3000:]
        assert re.search(r"data +my_corpus [\d,]+ tokens .*my_notes [\d,]+ tokens", out), out[-3000:]
        assert re.search(r"validation at step \d+: .*per source: my_corpus \S+, my_notes", out), out[-3000:]
    assert "world=2 (dp=2 tp=1 pp=1" in first and "steps        1 … 10" in first, first[-3000:]
    assert "world=2 (dp=1 tp=2+sp pp=1" in resumed and "steps        11 … 20 (resumed after step 10)" in resumed, \
        resumed[-3000:]
    assert "Qwen3ForCausalLM" in (tmp_path / "runs" / "finetune" / "hf" / "config.json").read_text()


# The demo's layout (configs/demo.toml) at test size: 4 steps (all of them in the parity check) of 2 micro-batches
# (the 1F1B pipeline still fills and drains) of 2 × 32 tokens (cp2 × tp2+sp still splits each sequence 4 ways)
# instead of 4 of 4 × 128. In float64 (its 1-process reference too): the 8 ranks' losses must equal the
# reference's to EXACT_RTOL, far inside the demo's own fp32 tolerance (`make demo` stays fp32).
DEMO_SMALL = ["train.steps=4", "train.warmup=1", "log.every=2", "log.progress=false", "train.seq_len=32",
              "train.micro_batch=2", "train.global_batch=4", FP64]


def test_demo_trains_5d_checks_parity_and_generates(tmp_path, default_dataset):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    argv = [PY, "-m", "pentatron.cli", "demo", *[f"--set={o}" for o in DEMO_SMALL],
            f"--set=data.path={json.dumps(str(default_dataset))}"]
    done = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    # all five dimensions: the banner, the summary
    assert "world=8 dp=1 tp=2 +sp pp=2 (1f1b) cp=2 (ring) ep=2" in out
    assert "world=8 (dp=1 tp=2+sp pp=2 cp=2 ring ep=2" in out and "run summary" in out
    assert "parity check — PASS" in out
    # The demo prints each step's losses and |diff| (demo.parity_report); fp64 holds them to EXACT_RTOL.
    rows = re.findall(r"step \d+: 1 process (\S+) +8 ranks \S+ +\|diff\| (\S+)", out)
    assert len(rows) == 4, out[-4000:]
    for loss, diff in rows:
        assert float(diff) <= EXACT_RTOL * float(loss), rows
    assert "tokens from runs/demo/checkpoint" in out
