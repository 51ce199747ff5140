"""The online-softmax steps of a block of KV rows for a GQA group's heads (see ``attention.group``).

``_mask_block_kind`` tells a block the mask hides from every head (skipped whole) or leaves at 0 (no mask
terms); ``mask_terms`` starts the scores from slope·mask (``-inf`` where the mask is ``-inf``, whatever the slope);
``store_score`` adds a logit (a hidden score stays ``-inf``); ``live_rows`` lists the rows some head of a register
block still needs; ``block_weights`` rescales the running sum ``S`` and output ``A`` to the block's new max and
turns scores into weights; ``finalize`` folds in the sink and normalises. The max skips NaN scores, so a NaN is
carried by ``S`` and reaches the output.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._core.kernel import fast_exp, kernel, to_f32

NEG_INF = np.float32(-np.inf)


class Logits(NamedTuple):
    """How a query-key dot product becomes a logit: times ``scale``, soft-capped by ``softcap`` (0: off), plus
    the head's ALiBi slope times its mask entry."""
    scale: np.float32
    softcap: np.float32
    slopes: np.ndarray  # (Hq,) float32


@kernel(llvm_inline=True)
def _logit(dot, scale, softcap):
    x = np.float32(dot * scale)
    if softcap != 0.0:
        x = np.float32(softcap * np.tanh(x / softcap))
    return x


@kernel(llvm_inline=True)
def store_score(sc, g, r, dot, scale, softcap, unmasked):
    """sc[g, r] = its logit (unmasked) or mask term + logit; a hidden score (mask term -inf) stays -inf, whatever
    the K row holds (a row hidden for one head of a register block may be live for another)."""
    if unmasked:
        sc[g, r] = _logit(dot, scale, softcap)
    else:
        x = sc[g, r]
        sc[g, r] = x if x == NEG_INF else x + _logit(dot, scale, softcap)


@kernel(inline=True)
def live_rows(sc, g, width, n, every, dead, rows):
    """rows[:k] = the rows r < n where sc[g .. g+width, r] is not ``dead`` for some head; returns k. ``every``:
    all n rows (no mask: nothing to skip, and a row of zero weights adds nothing)."""
    if every:
        for r in range(n):
            rows[r] = r
        return n
    n_live = 0
    for r in range(n):
        for t in range(width):
            if sc[g + t, r] != dead:
                rows[n_live] = r
                n_live += 1
                break
    return n_live


#: Kinds of a block of mask entries for a group's heads (``_mask_block_kind``).
BLOCK_HIDDEN = 0  # every entry -inf: the block adds nothing (no new max, weights 0); skipped, K/V not read
BLOCK_ZERO = 1  # every entry 0 (or -0): the scores are the logits; no mask terms
BLOCK_ADD = 2  # anything else: mask terms added


@kernel(inline=True)
def _mask_block_kind(mf, mask_at, h0, G, jb, n):
    """The kind (BLOCK_*) of mask columns jb .. jb+n for heads h0 .. h0+G, which read min(G, Hm) mask heads.
    Reads the n entries of each without branching (vectorised); a NaN entry makes the block BLOCK_ADD."""
    Hm = mask_at.n_heads
    mcs = mask_at.column_stride
    live = 0
    nonzero = 0
    for t in range(min(G, Hm)):
        start = mask_at.base + ((h0 + t) % Hm) * mask_at.head_stride + jb * mcs
        if mcs == 1:  # two loops: a select between the two addressings inside one loop does not vectorise
            u = np.uint64(start)  # unsigned: a signed index's negative-index wrap stops vectorisation
            for r in range(n):
                x = to_f32(mf[u + np.uint64(r)])
                live += x != NEG_INF
                nonzero += x != 0.0
        else:
            for r in range(n):
                x = to_f32(mf[start + r * mcs])
                live += x != NEG_INF
                nonzero += x != 0.0
    if live == 0:
        return BLOCK_HIDDEN
    return BLOCK_ZERO if nonzero == 0 else BLOCK_ADD


@kernel(inline=True)
def block_mask(mf, mask_at, h0, G, jb, n):
    """(hidden, terms) of a block of n columns for heads h0 .. h0+G: hidden from every head (the caller skips it,
    its K/V unread), and whether its mask terms must be added (no mask, or an all-0 block: the scores are the
    logits). (False, False) without a mask. ``mf``: the flat mask (None: no mask), read at ``mask_at``
    (``attention.layout.MaskAt``)."""
    if mf is None:
        return False, False
    kind = _mask_block_kind(mf, mask_at, h0, G, jb, n)
    return kind == BLOCK_HIDDEN, kind == BLOCK_ADD


@kernel(inline=True)
def mask_terms(sc, n, mf, mask_at, slopes, h0, jb):
    """sc[g, :n] = slope * mask of head h0 + g over the block's columns jb .. jb+n (nothing without a mask)."""
    if mf is not None:
        Hm = mask_at.n_heads
        mcs = mask_at.column_stride
        for g in range(sc.shape[0]):
            h = h0 + g
            start = mask_at.base + (h % Hm) * mask_at.head_stride + jb * mcs
            slope = slopes[h]
            for r in range(n):
                x = to_f32(mf[start + r * mcs])
                sc[g, r] = NEG_INF if x == NEG_INF else slope * x  # hidden, even for a slope of 0


@kernel(inline=True)
def block_weights(sc, n, M, S, A):
    """Per head g of sc (G, >= n): rescale S[g] and A's head g to the block's new max, sc[g, :n] = weights."""
    G = sc.shape[0]
    DV = A.shape[0] // G
    for g in range(G):
        block_max = NEG_INF
        for r in range(n):
            block_max = max(block_max, sc[g, r])
        if block_max == NEG_INF:
            # nothing live, or only NaN scores (max skips NaN): a NaN stays as its weight, so S turns NaN
            total = np.float32(0.0)
            for r in range(n):
                x = sc[g, r]
                p = np.float32(0.0) if x == NEG_INF else x
                sc[g, r] = p
                total += p
            S[g] += total
            continue
        if block_max > M[g]:
            factor = fast_exp(M[g] - block_max)  # 0 while M is still -inf
            S[g] *= factor
            a0 = g * DV
            for d in range(DV):
                A[a0 + d] *= factor
            M[g] = block_max
        m = M[g]
        total = np.float32(0.0)
        for r in range(n):
            p = fast_exp(sc[g, r] - m)
            sc[g, r] = p
            total += p
        S[g] += total


@kernel(inline=True)
def _max_nan(a, b):
    """max(a, b), NaN when either is NaN (Python's max keeps the first argument when the second is NaN)."""
    return a if (a > b or a != a) else b


@kernel
def finalize(m, s, A, a0, DV, sink, of, obase, ocs):
    """out = A[a0:a0+DV] / (s + exp(sink - m)), both terms rescaled to max(m, sink); zeros when nothing is live.

    The DV outputs go to flat offsets ``obase + d * ocs`` of ``of``. A NaN score leaves s NaN (``m`` may still be
    -inf) and a NaN sink makes the max NaN: both give NaN outputs.
    """
    top = _max_nan(sink, m)
    if top == NEG_INF and s == 0.0:
        for d in range(DV):
            of[obase + d * ocs] = 0.0
        return
    factor = fast_exp(m - top)  # 0 when m is -inf (only the sink is live: the output is 0)
    total = s * factor + fast_exp(sink - top)
    weight = factor / total
    acc = A[a0:a0 + DV]
    for d in range(DV):
        of[obase + d * ocs] = acc[d] * weight
