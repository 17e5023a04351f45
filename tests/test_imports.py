"""The package's import structure: no import cycle anywhere inside `src/pentatron`, and data flowing one way
(config → layout → model → parallelize → step runner → trainer): `parallel/` never imports `train/`.

Imports are read from the source: every `import` statement, also those inside functions and under
`if TYPE_CHECKING:`, so a cycle hidden behind a lazy or annotation-only import is still a cycle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "pentatron"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = me.split(".")[: len(me.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out.update(n for n in names if n in modules and n != me)
    return out


def _graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_graph_is_read():
    graph = _graph()
    assert "pentatron.layout" in graph["pentatron.config"]  # a known edge: the reader works


def test_no_import_cycle_inside_the_package():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_parallel_never_imports_train():
    bad = {m: sorted(n for n in deps if n.startswith("pentatron.train"))
           for m, deps in _graph().items() if m.startswith("pentatron.parallel")}
    bad = {m: v for m, v in bad.items() if v}
    assert not bad, f"parallel/ imports train/: {bad}"


def test_hardware_imports_no_consumer():
    """hardware/ (datasheets, bench profiles, the Speeds interface) sits below the planner, the trainer's MFU and
    `pentatron bench`: it reads only the ring's byte count from distributed/."""
    allowed = {"pentatron.distributed.ring", "pentatron.user_files"}  # the latter a leaf: the file reader
    bad = {m: sorted(n for n in deps if not n.startswith("pentatron.hardware") and n not in allowed)
           for m, deps in _graph().items() if m.startswith("pentatron.hardware")}
    bad = {m: v for m, v in bad.items() if v}
    assert not bad, f"hardware/ imports a consumer: {bad}"


def test_a_training_start_does_not_import_torch_dynamo():
    """Building the model on meta and stepping AdamW leave torch._dynamo unimported: it costs every rank
    ~1.4 s of CPU at start-up (nn.Embedding's own init on meta and torch.optim.AdamW's construction
    imported it). A fresh interpreter, as a rank is."""
    code = """
import sys, torch
from pentatron.config import TrainConfig
from pentatron.models.llama import build_meta_model, build_model
from pentatron.models.registry import get_model_config
from pentatron.optim import AdamW, param_slots
build_meta_model(get_model_config("debug-moe"))
model = build_model(get_model_config("debug"))
params = list(model.parameters())
for p in params:
    p.main_grad = torch.ones_like(p)
AdamW(param_slots(params, [str(i) for i in range(len(params))], torch.float32), TrainConfig()).step(1e-3)
print("torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(PKG.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False", "a training start imports torch._dynamo again"
