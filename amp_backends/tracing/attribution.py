"""Which module an op belongs to, forward and backward.

Forward: the innermost module whose forward is running (forward pre- and post-hooks keep the stack).
Backward: the module whose forward created the autograd node being executed
(``torch._C._current_autograd_node()``): while the forward runs, a ``TorchFunctionMode`` maps every
node a call creates (the one it returns and those made inside it, down to the nodes of its inputs)
to the module running. Exact where a module's inputs need no gradient, where torch's
``ModuleTracker`` (which watches module inputs and outputs) loses track.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..torch_private import current_autograd_node, current_graph_task_id, tree_leaves

__all__ = ["Attribution"]


class Attribution(TorchFunctionMode):
    """Enter around the forward (and keep for the backward: :meth:`where` answers then too)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.nodes: dict[Any, str] = {}
        self._handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(self._push),
                                                               m.register_forward_hook(self._pop, always_call=True))]

    def _push(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), "(outside the model)"))

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            here = self.stack[-1] if self.stack else "(outside the model)"
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    self._claim(t.grad_fn, here)
        return out

    def _claim(self, node: Any, module: str) -> None:
        todo = [node]
        while todo:
            n = todo.pop()
            if n is None or n in self.nodes or type(n).__name__ == "AccumulateGrad":
                continue
            self.nodes[n] = module
            todo.extend(next_fn for next_fn, _ in n.next_functions)

    def where(self) -> tuple[str, bool]:
        """(module, backward) for the op running now."""
        node = current_autograd_node()
        if node is not None:
            return self.nodes.get(node, "(outside the model)"), True
        if current_graph_task_id() != -1:  # the engine's own work (a captured gradient's detach)
            return "(autograd)", True
        return (self.stack[-1] if self.stack else "(outside the model)"), False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
