"""Keeping a `jax.vjp` across pipeline ticks: its residual arrays go into fixed-size
buffers (the stash), the rest of it is static and kept here at trace time.

    saver = SavedVJP()
    out, vjp = jax.vjp(f, params, x)
    arrays = saver.save(vjp, params)       # at the forward tick: write into the stash
    vjp = saver.restore(arrays, params)    # at the backward tick: read from the stash
    d_params, d_x = vjp(ct)

Residuals that are the parameters themselves (jax.vjp keeps arguments it needs verbatim)
are not stashed: `restore` takes them from the stage's weights again, so the stash holds
activations only. `save` of a vjp traced with the same function and argument types
always yields the same list of arrays (`shapes` gives them for allocation).
"""

from __future__ import annotations

import jax

_PARAM, _ARRAY, _STATIC = 0, 1, 2


class SavedVJP:
    def __init__(self):
        self._template = None  # the VJP with its residual fields removed
        self._plan = None  # per residual leaf: (_PARAM, param index) | (_ARRAY, None) | (_STATIC, obj)
        self._defs = None  # treedefs of args_res and structured_residuals

    def save(self, vjp, params) -> list[jax.Array]:
        param_index = {id(x): i for i, x in enumerate(jax.tree.leaves(params))}
        args, args_def = jax.tree.flatten(vjp.args_res)
        structured, structured_def = jax.tree.flatten(vjp.structured_residuals)
        plan, arrays = [], []
        for leaf in args + list(vjp.opaque_residuals) + structured:
            if id(leaf) in param_index:
                plan.append((_PARAM, param_index[id(leaf)]))
            elif isinstance(leaf, jax.Array):
                plan.append((_ARRAY, None))
                arrays.append(leaf)
            else:
                plan.append((_STATIC, leaf))
        self._template = vjp.replace(args_res=None, opaque_residuals=None,
                                     structured_residuals=None)
        self._plan = plan
        self._defs = (args_def, len(args), len(vjp.opaque_residuals), structured_def)
        return arrays

    def restore(self, arrays, params):
        if self._template is None:
            raise RuntimeError("SavedVJP.restore before save: trace the forward first")
        param_leaves = jax.tree.leaves(params)
        arrays = iter(arrays)
        leaves = [param_leaves[x] if kind == _PARAM else next(arrays) if kind == _ARRAY else x
                  for kind, x in self._plan]
        args_def, n_args, n_opaque, structured_def = self._defs
        return self._template.replace(
            args_res=jax.tree.unflatten(args_def, leaves[:n_args]),
            opaque_residuals=leaves[n_args: n_args + n_opaque],
            structured_residuals=jax.tree.unflatten(structured_def, leaves[n_args + n_opaque:]),
        )
