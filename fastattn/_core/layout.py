"""Merging an op's leading (batch-like) axes into one, without copying, so one 2-D/3-D kernel serves any rank.

Row-wise ops (RMSNorm, SET_ROWS, ...) see arrays as ``lead + tail``: ``lead`` the leading axes they loop over,
``tail`` the axes one kernel iteration handles. Two kinds of operand share ``lead``:

- *full* operands (``x``, ``out``) have exactly ``lead``;
- *tiled* operands (a norm weight ``w``, SET_ROWS's ``idx``) have leading lengths that each divide ``lead``'s and
  are repeated along every axis, as ggml repeats the second operand of MUL/ADD: element ``i`` of a leading axis of
  length ``n`` reads element ``i % n`` of the tiled operand.

``merge_leading`` turns the leading axes into a single one: row ``r`` of a merged full operand pairs with row
``r % len`` of a merged tiled operand (proof: if the tiled shape is ``(1, .., 1, t_j, n_j+1, .., n_m)`` with
``t_j | n_j``, the full rows before axis ``j`` advance ``r`` by multiples of ``t_j * n_j+1 * .. * n_m``). When the
strides do not allow a view (a permuted or sliced batch axis) it peels the first leading axis off in Python and
tries again on each slice, so the result is a list of blocks, a single one for every layout seen in practice.
Nothing is ever copied: ``reshape(copy=False)`` raises instead.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Block = tuple[list[np.ndarray], list[np.ndarray]]


def merge_leading(full: Sequence[np.ndarray], tiled: Sequence[np.ndarray], n_lead: int) -> list[Block]:
    """Blocks of views with one leading axis each; see the module docstring.

    ``full``: arrays whose first ``n_lead`` axes are the same ``lead`` shape. ``tiled``: arrays with exactly
    ``n_lead`` leading axes (left-pad with length-1 axes first), each length dividing ``lead``'s.
    """
    if n_lead == 0:
        return [([a[None] for a in full], [t[None] for t in tiled])]
    if n_lead == 1:
        return [(list(full), list(tiled))]
    lead = full[0].shape[:n_lead]
    try:
        rows = math.prod(lead)
        merged_full = [a.reshape((rows,) + a.shape[n_lead:], copy=False) for a in full]
        merged_tiled = [_merge_tiled(t, lead, n_lead) for t in tiled]
        return [(merged_full, merged_tiled)]
    except ValueError:  # a stride pattern a view cannot express: loop over the first axis
        pass
    blocks = []
    for i in range(lead[0]):
        blocks += merge_leading([a[i] for a in full], [t[i % t.shape[0]] for t in tiled], n_lead - 1)
    return blocks


def _merge_tiled(t: np.ndarray, lead: tuple[int, ...], n_lead: int) -> np.ndarray:
    """``t``'s leading axes as one, if its shape is ``(1, .., 1, t_j, lead[j+1:])`` and its strides allow."""
    t_lead = t.shape[:n_lead]
    j = next((k for k, n in enumerate(t_lead) if n != 1), n_lead)
    if t_lead[j + 1:] != lead[j + 1:]:
        raise ValueError("a tiled axis after a partial one: no single row period")
    return t.reshape((math.prod(t_lead),) + t.shape[n_lead:], copy=False)
