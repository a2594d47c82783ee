"""The lazy IR (layer 2): op table, nodes, optimiser passes, plans and the executor.

Imports ``errors``, ``dtypes`` and ``backend`` only. Importing this package fills the op
table (definitions only; nothing runs). The parts, in the order a graph meets them:

- ``op``: the :class:`Op` record and the table; ``elementwise``, ``structural`` and
  ``reduce`` register the primitives (rule, Array API kernel and vjp side by side);
- ``node``: :class:`Node` (:func:`make` runs the op's rule), leaves and constants;
- ``host``: the ``host`` op, Python run on host copies of its inputs when the graph runs;
- ``build``: builders with promotion and scalars, used by the vjps and the Tensor front;
- ``passes``: lowering to a flat IR, simplify/CSE/fold, DCE;
- ``plan``: fusion groups, the linear schedule of typed steps, the memory plan;
- ``fused``: fused programs (numpy out= in cache-sized chunks, cupy kernel source);
- ``executor``: the one realise path: a cached plan binds the graph or one is made; the
  run, counting live bytes.
"""

from __future__ import annotations

from . import build, elementwise, host, reduce, structural
from .executor import Executor, PlanCache, default_executor, realize, recording
from .node import Node, array_dtype, const, leaf, make, mark_realised
from .op import OPS, Op, get_op, register
from .passes import Instr, lower, optimise
from .plan import Plan, make_plan

__all__ = [
    "OPS", "Executor", "Instr", "Node", "Op", "Plan", "PlanCache", "array_dtype", "build",
    "const", "default_executor", "elementwise", "get_op", "host", "leaf", "lower", "make",
    "make_plan", "mark_realised", "optimise", "realize", "recording", "reduce", "register",
    "structural",
]
