"""Backward split in two for zero-bubble schedules: B (input gradients) now, W (weight gradients) later.

B must be cheap and on the critical path (the upstream stage waits for its result); W can be deferred
to fill a bubble. The W pass must compute *only* the weight gradients, from state saved by B: it must
not run the backward a second time.

How. The autograd graph of one stage's forward is split at the nodes where the activation path meets
a weight path ("split nodes": e.g. the matmul of a Linear, whose backward yields both dX and dW):

* B runs `autograd.grad(outputs, inputs=stage inputs, retain_graph=True)`. Autograd executes only the
  nodes on a path to the inputs, and inside each node computes only the gradients that are needed, so
  a Linear's `mm` backward produces dX but not dW. A pre-hook on every split node captures the gradient
  flowing *into* that node (dY of the Linear) as it passes.
* W re-enters the graph at exactly those split nodes, with the captured gradients as the incoming
  gradients, and asks for the parameters only: autograd now computes just the weight branch of each
  split node (dW = dYᵀX for a Linear) and the parameter-only nodes below it, and accumulates into
  `.grad` as an ordinary backward would (so data-parallel gradient hooks still fire).

Outputs that do not depend on any stage input (the first stage's: its input is token ids) have no B
work at all; their whole backward is weight gradients, so W starts from the outputs themselves.
FLOPs(B) + FLOPs(W) = FLOPs(unsplit backward); `tests/.../test_split_backward.py` measures it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def _node_of(t: torch.Tensor) -> Node | None:
    """The autograd node that receives this tensor's gradient (AccumulateGrad for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return torch.autograd.graph.get_gradient_edge(t).node
    return None


class _Graph:
    """Reachability over the autograd graph below `roots`: which nodes lead to a stage input (B runs
    them) and which lead to a weight."""

    def __init__(self, roots: Sequence[Node], input_nodes: set[Node]) -> None:
        self.children: dict[Node, list[Node]] = {}
        self.params: dict[Node, torch.Tensor] = {}  # AccumulateGrad node -> parameter
        self.to_input: set[Node] = set()
        self.to_param: set[Node] = set()
        # Iterative post-order (children before parents), so each flag is the OR of the children's.
        stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                kids = self.children[node]
                if node in input_nodes or any(k in self.to_input for k in kids):
                    self.to_input.add(node)
                if node in self.params or any(k in self.to_param for k in kids):
                    self.to_param.add(node)
                continue
            if node in self.children:
                continue
            kids = [n for n, _ in node.next_functions if n is not None]
            self.children[node] = kids
            var = getattr(node, "variable", None)
            if var is not None and node not in input_nodes:
                self.params[node] = var
            stack.append((node, True))
            stack.extend((k, False) for k in kids if k not in self.children)

    def weight_only(self, node: Node) -> bool:
        return node not in self.to_input and node in self.to_param

    def split_nodes(self) -> list[Node]:
        """Nodes run by B (they lead to an input) with a child that only W needs (leads to a weight, not
        to an input): the places where W re-enters the graph."""
        return [n for n in self.children if n in self.to_input and any(self.weight_only(k) for k in self.children[n])]

    def params_below(self, nodes: Sequence[Node]) -> list[Node]:
        """The weights (AccumulateGrad nodes) reachable from `nodes`, walking weight-only nodes only."""
        found, seen = [], set()
        stack = [n for n in nodes if self.weight_only(n)]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in self.params:
                found.append(node)
            stack.extend(k for k in self.children[node] if self.weight_only(k) and k not in seen)
        return found


class SplitBackward:
    """The backward of one (chunk, micro-batch), run as B then W.

    `outputs`/`grad_outputs`: what the stage produced and the gradients arriving for them (None for a
    scalar loss). `inputs`: the stage's differentiable inputs (leaves that require grad; may be empty).
    In the rare graph where a weight is shared along the activation path inside one stage (the split
    would double count it), B runs the full backward and W has nothing left to do: still correct,
    just not split; `split` tells which happened.
    """

    def __init__(self, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
                 inputs: Sequence[torch.Tensor]) -> None:
        self.outputs = list(outputs)
        # A scalar loss has the implicit incoming gradient 1, as in `loss.backward()`.
        self.grad_outputs = [torch.ones_like(o) if g is None else g
                             for o, g in zip(self.outputs, grad_outputs, strict=True)]
        self.inputs = [t for t in inputs if t.requires_grad]
        # W's work: (graph edges to re-enter at, the gradients arriving there, the weights to reach).
        self._w_calls: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = []
        self._done_b = False
        self.split = True

    def backward_input(self) -> list[torch.Tensor | None]:
        """B: gradients w.r.t. the stage inputs (None for an input that does not affect the outputs),
        capturing at each split node the gradient W will need."""
        if self._done_b:
            raise RuntimeError("backward_input called twice for the same micro-batch")
        self._done_b = True
        input_nodes = {n for n in map(_node_of, self.inputs) if n is not None}
        roots = [n for n in map(_node_of, self.outputs) if n is not None]
        graph = _Graph(roots, input_nodes)
        splits = graph.split_nodes()
        split_params = {n: graph.params_below(graph.children[n]) for n in splits}
        # W re-enters at each split node with `inputs=` its own weights. That is exact only if no weight
        # is below two split nodes (a weight shared along the activation path): autograd would reach it
        # again through the activation side of the upper one and count that path twice.
        owners = [p for ps in split_params.values() for p in ps]
        if len(owners) != len(set(owners)):
            self.split = False
            torch.autograd.backward(self.outputs, self.grad_outputs, inputs=self.inputs + list(graph.params.values()))
            return [t.grad for t in self.inputs]

        # Outputs with no path to an input: B has nothing to do for them; W starts right at the output.
        direct = [(o, g) for o, g in zip(self.outputs, self.grad_outputs, strict=True)
                  if (n := _node_of(o)) is not None and graph.weight_only(n)]
        if direct:
            params = graph.params_below([_node_of(o) for o, _ in direct])
            self._w_calls.append(([torch.autograd.graph.get_gradient_edge(o) for o, _ in direct],
                                  [g for _, g in direct], [graph.params[n] for n in params]))
        b_outputs = [(o, g) for o, g in zip(self.outputs, self.grad_outputs, strict=True)
                     if _node_of(o) in graph.to_input]
        if not b_outputs:
            return [None] * len(self.inputs)

        captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        handles = []
        for node in splits:
            def hook(grads: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
                captured[node] = grads  # the full incoming gradient: the hook runs once, after accumulation
            handles.append(node.register_prehook(hook))
        try:
            grads = torch.autograd.grad([o for o, _ in b_outputs], self.inputs, [g for _, g in b_outputs],
                                        retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for node, gs in captured.items():
            edges = [(GradientEdge(node, k), g) for k, g in enumerate(gs) if g is not None]
            if edges:
                params = [graph.params[n] for n in split_params[node]]
                self._w_calls.append(([e for e, _ in edges], [g for _, g in edges], params))
        return list(grads)

    def backward_weight(self) -> None:
        """W: accumulate the weight gradients into `.grad`, re-entering the graph at each split node with
        the gradient B captured there; `inputs=` limited to that node's weights keeps autograd on the
        weight branch (it never walks the activation path again)."""
        if not self._done_b:
            raise RuntimeError("backward_weight called before backward_input")
        calls, self._w_calls = self._w_calls, []
        for i, (edges, grads, params) in enumerate(calls):
            # The last call may free the graph; the others share its upper part (retain it).
            torch.autograd.backward(edges, grads, inputs=params, retain_graph=i < len(calls) - 1)
        # Drop every reference to the graph and the captured gradients: the activations go with them.
        self.outputs, self.grad_outputs, self.inputs = [], [], []
