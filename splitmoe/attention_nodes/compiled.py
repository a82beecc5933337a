"""The decode step's per-layer compute through ``torch.compile`` (gpt-fast's approach: the same
code, compiled), with the paged attention and the experts left outside.

`AttentionModel.layer_segment` runs a layer as three calls: `AttentionModel.layer_in` (residual
add, norm, QKV projection, q/k norms, RoPE), the attention backend's store and attend, and
`AttentionModel.layer_out` (output projection, residual, norm, dense MLP or router). The first
and last are pure functions of their tensors; `CompiledPieces` compiles those two and nothing
else: the paged-attention kernel reads per-sequence metadata that changes every step, and the
MoE calls cross ranks. Each piece compiles lazily at its first call (one graph per layer kind:
dense or MoE, MHA or MLA), a second row count makes the row dimension dynamic (no recompile per
batch size after that); steps with no rows (an idle rank's micro-batch) stay eager.

A compile or run failure inside a compiled piece falls back to the eager piece for the rest of
the run with one warning (the pieces write nothing in place, so running one again is safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("splitmoe")


class GuardedCompile:
    """``fn`` through ``compiler`` (``torch.compile``), or ``fn`` itself once compiling or
    running the compiled version raised (one warning). ``rows_arg``: the positional argument
    whose first dimension counts the rows; a call with no rows runs ``fn``."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        compiler: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compile,
        rows_arg: int = 1,
    ):
        self.eager = fn
        self.name = name
        self.rows_arg = rows_arg
        self.compiled: Callable[..., Any] | None = compiler(fn)
        self.error: str | None = None  # why it fell back, once it did

    def __call__(self, *args):
        if self.compiled is not None and args[self.rows_arg].shape[0]:
            try:
                return self.compiled(*args)
            except Exception as e:  # (any failure of Dynamo, Inductor or the C++ compiler)
                self.compiled = None
                root = e  # (Dynamo wraps a backend's error: name the one underneath)
                while (inner := getattr(root, "inner_exception", root.__cause__)) is not None:
                    root = inner
                lines = str(root).strip().splitlines()
                self.error = f"{type(root).__name__}: {lines[0] if lines else ''}"
                logger.warning(
                    "torch.compile of %s failed (%s); running it eagerly (enforce_eager=True "
                    "skips compiling)",
                    self.name,
                    self.error,
                )
        return self.eager(*args)


class CompiledPieces:
    """`AttentionModel.layer_in` and `layer_out` of ``model``, each a `GuardedCompile`."""

    def __init__(self, model, compiler: Callable | None = None):
        compiler = compiler or torch.compile
        self.layer_in = GuardedCompile(model.layer_in, "layer_in", compiler)
        self.layer_out = GuardedCompile(model.layer_out, "layer_out", compiler)

    @property
    def errors(self) -> dict[str, str]:
        """The pieces that fell back to eager, and why."""
        return {p.name: p.error for p in (self.layer_in, self.layer_out) if p.error}
