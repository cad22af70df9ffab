"""Top-k, top-p and min-p on a batch of rows, reading the whole vocabulary only where the
result depends on all of it.

The cuts keep what a full sort of each row would keep: top-k every token at least the row's
k-th largest value, top-p every token whose more likely tokens (probability descending, lower
token id first among equal probabilities, as a stable sort orders them) hold less than
``top_p``, min-p every token of at least ``min_p`` times the row's top probability. The
softmaxes and sums stay full rows (their float rounding is the full row's); what shrinks is
the search for the cut, which runs over a few hundred candidates per row, never a sort or a
``topk(1024)`` of 49k tokens:

1. **Candidates by groups.** The row is split into ``V // 16`` groups of 16 tokens (token
   ``g + C * j`` is member ``j`` of group ``g``: a strided view, so the group maxima are one
   vectorised reduction) and the members of the ``m`` groups with the largest maxima are the
   candidates. At least ``m`` candidates are at least the ``m``-th group maximum (``bound``),
   and every other token is at most ``bound``: so the k-th largest value of the candidates is
   the row's for every ``k <= m``, and the candidates above ``bound`` are the row's first
   tokens in sorted order.
2. **Top-k** takes the k-th value from the candidates and keeps the candidates at least it;
   a row whose kept tokens may lie outside them (that value tied across more than ``m``
   groups, or fewer than ``k`` finite tokens) is cut by a comparison over the row instead.
3. **Top-p** decides the nucleus over the candidates' reliably ordered prefix when that
   prefix holds ``top_p`` (with a margin for the cumulative sum's rounding): from the top-k
   survivors, else from 64 groups, else from the 1024 most likely tokens, else from a
   stable sort of the whole row. Either way the kept tokens and the cumulative sums that
   decide them are bit for bit those of the full sort.
4. What is kept is returned as a ``Support``: per row the ascending ids outside which every
   probability is zero, so min-p and the inverse-CDF draw work on them alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUP = 16  # tokens per candidate group
TOP_P_GROUPS = 64  # groups searched first for a nucleus without a top-k cut
TOP_P_CANDIDATES = 1024  # the most likely tokens searched next, before a full sort
# A prefix must hold top_p by this much to decide the nucleus: the float32 cumulative sums
# of the full sort differ from the prefix's total by a few units in the last place.
TOP_P_MARGIN = 1e-5


class Support(NamedTuple):
    """Per row, the tokens outside which every probability is zero.

    Attributes:
        ids: ``[N, K]`` int64, ascending; ``V`` pads a row (and fills a row without one).
        rows: ``[N]`` bool, rows that have a support (the others are dense).
    """

    ids: torch.Tensor
    rows: torch.Tensor


def truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor | None, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, Support | None]:
    """Temperature-scaled logits ``[N, V]`` (overwritten) -> the probabilities ``[N, V]``
    after the top-k, top-p and min-p cuts, and the support of the rows they cut.

    Args:
        scaled: ``[N, V]`` float32; its cut rows are left with -inf outside what they keep.
        top_k: ``[N]`` int64 (0 or at least V: no cut).
        top_p: ``[N]`` float32 (1.0: no cut).
        min_p: ``[N]`` float32 or None; when set every row is renormalised after it (a row
            with 0 too).
        out: ``[N, V]`` float32 for the probabilities (default a fresh tensor).
    """
    support = _cut_top_k(scaled, top_k)
    if bool((top_p < 1.0).any()):
        # The probabilities before the nucleus cut go to ``out`` too: dead once it is made.
        support = _cut_top_p(scaled, top_p, support, out)
    probs = scaled.softmax(-1) if out is None else torch.softmax(scaled, -1, out=out)
    if min_p is not None:
        _cut_min_p(probs, min_p, support)
    return probs, support


def top_groups(values: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidates of step 1: ``values`` ``[N, V]`` -> ``(ids [N, G], bound [N],
    group_max [N, C])``: every token outside ``ids`` is at most ``bound``, at least ``m``
    tokens of ``ids`` are at least it, and ``group_max`` holds every group's maximum.

    The groups are found the same way one level up when there are enough of them: the ``m``
    best of the groups in the ``m`` best super-groups of 16 groups (every group outside those
    is at most the ``m``-th super-group maximum, which at least ``m`` groups inside reach).
    A vocabulary too small for groups of 16 makes every token a group; tokens (and groups)
    past the last whole group are always candidates.
    """
    num_rows, vocab = values.shape
    dev = values.device
    if vocab // GROUP < m:
        top = values.topk(m, dim=-1)
        return top.indices, top.values[:, -1], values
    num_groups = vocab // GROUP
    body = values[:, :num_groups * GROUP].view(num_rows, GROUP, num_groups)
    group_max = body.amax(1)  # [N, C]; group g holds tokens g + C * j
    num_super = num_groups // GROUP
    if num_super >= m:
        super_max = group_max[:, :num_super * GROUP].view(num_rows, GROUP, num_super).amax(1)
        best = super_max.topk(m, dim=-1).indices  # [N, m]
        groups = (best[:, :, None] + torch.arange(GROUP, device=dev) * num_super).view(
            num_rows, m * GROUP)
        if num_super * GROUP < num_groups:
            rest = torch.arange(num_super * GROUP, num_groups, device=dev)
            groups = torch.cat([groups, rest.expand(num_rows, -1)], 1)
        top = group_max.gather(1, groups).topk(m, dim=-1)
        chosen = groups.gather(1, top.indices)  # [N, m]
    else:
        top = group_max.topk(m, dim=-1)
        chosen = top.indices
    ids = (chosen[:, :, None] + torch.arange(GROUP, device=dev) * num_groups).view(
        num_rows, m * GROUP)
    if num_groups * GROUP < vocab:
        tail = torch.arange(num_groups * GROUP, vocab, device=dev)
        ids = torch.cat([ids, tail.expand(num_rows, -1)], 1)
    return ids, top.values[:, -1], group_max


def top_n(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest of each row of ``values`` ``[M, V]`` (``n <= V``) as ``(values,
    ids)`` ``[M, n]``: largest first, the lower token id first among equal values (as a
    stable sort orders them), found among the candidates of ``top_groups``; a row whose
    n-th value ties across more groups than were searched is sorted whole."""
    vocab = values.shape[-1]
    ids, _, group_max = top_groups(values, n)
    nth = values.gather(1, ids).topk(n, dim=-1).values[:, -1:]  # [M, 1]
    # Every token at least nth is a candidate (a row of NaN is sorted whole, too).
    inside = ((group_max >= nth).sum(-1) <= n) & ~nth[:, 0].isnan()
    if not bool(inside.all()):
        out = (~inside).nonzero()[:, 0]
        ids = ids.clone()
        ids[out] = vocab  # padding: these rows are sorted whole below
    cand = ids.sort(-1).values  # ascending ids: the stable sort keeps equal values in id order
    picked = values.gather(1, cand.clamp(max=vocab - 1)).masked_fill(cand == vocab,
                                                                      float("-inf"))
    top_values, order = picked.sort(dim=-1, descending=True, stable=True)
    top_values, top_ids = top_values[:, :n], cand.gather(1, order[:, :n])
    if not bool(inside.all()):
        whole = values[out].sort(dim=-1, descending=True, stable=True)
        top_values[out], top_ids[out] = whole.values[:, :n], whole.indices[:, :n]
    return top_values, top_ids


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # Indexing copies: the whole tensor when the rows are all of it.
    return t if rows.numel() == t.shape[0] else t[rows]


def _cut_top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> Support | None:
    """Set every token of ``scaled`` ``[N, V]`` below its row's ``top_k``-th largest value to
    -inf, in place. Returns the kept tokens of the rows cut from candidates, or None when no
    row cuts."""
    num_rows, vocab = scaled.shape
    dev = scaled.device
    cut = (top_k > 0) & (top_k < vocab)
    if not bool(cut.any()):
        return None
    rows = cut.nonzero()[:, 0]
    sub = _rows(scaled, rows)  # [M, V]
    k = top_k[rows]
    k_max = int(k.max())
    ids, _, group_max = top_groups(sub, k_max)
    values = sub.gather(1, ids)  # [M, G]
    top = values.topk(k_max, dim=-1)
    kth = top.values.gather(1, (k - 1)[:, None])  # [M, 1]
    # Every token at least kth is a candidate when at most k_max groups reach it (those are
    # then all among the k_max searched); else the row is cut by a comparison over it.
    inside = (group_max >= kth).sum(-1) <= k_max  # [M]
    kept = (values >= kth) & inside[:, None]  # [M, G]
    width = max(int(kept.sum(-1).max()), 1)
    if width <= k_max:  # the kept tokens are among the k_max largest (ties included)
        top_values, top_ids = top.values, ids.gather(1, top.indices)
    else:
        more = values.masked_fill(~kept, float("-inf")).topk(width, dim=-1)
        top_values, top_ids = more.values, ids.gather(1, more.indices)
    valid = (top_values >= kth) & inside[:, None]  # [M, W]
    if not bool(inside.all()):
        out = (~inside).nonzero()[:, 0]
        dense = sub[out]
        sub[out] = dense.masked_fill_(dense < kth[out], float("-inf"))
    if bool(inside.any()):
        if bool(inside.all()):
            sub.fill_(float("-inf"))
        else:
            sub[inside] = float("-inf")
        r, c = valid.nonzero(as_tuple=True)
        sub[r, top_ids[r, c]] = top_values[r, c]
    if sub is not scaled:
        scaled[rows] = sub
    support = torch.full((num_rows, top_ids.shape[1]), vocab, dtype=torch.int64, device=dev)
    support[rows] = top_ids.masked_fill(~valid, vocab).sort(-1).values
    has = torch.zeros(num_rows, dtype=torch.bool, device=dev)
    has[rows] = inside
    return Support(support, has)


def _nucleus(probs: torch.Tensor, cand: torch.Tensor, bound: torch.Tensor,
             top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-p over candidates: ``probs`` ``[M, V]``, ``cand`` ``[M, K]`` ids (``V`` pads) of
    which every other token has a probability at most ``bound`` ``[M]`` (below 0: ``cand``
    is the whole row) -> ``(ids [M, K], keep [M, K] bool, decided [M] bool)``: the candidates
    most likely first (``V`` padding last), those in the nucleus, and the rows whose
    candidates above ``bound`` hold ``top_p`` (only those rows' ``keep`` is the nucleus)."""
    vocab = probs.shape[-1]
    cand = cand.sort(-1).values  # ascending ids: a stable sort then orders ties by id
    valid = cand < vocab
    p = probs.gather(1, cand.clamp(max=vocab - 1)).masked_fill(~valid, -1.0)  # [M, K]
    p_sorted, order = p.sort(dim=-1, descending=True, stable=True)
    ids = cand.gather(1, order)
    # The candidates above bound come first in the full sort too, in the same order, so
    # their cumulative sums are the full sort's.
    reliable = p_sorted > bound[:, None]
    total = p_sorted.clamp(min=0.0).cumsum(-1)
    keep = reliable & (total - p_sorted < top_p[:, None])
    reach = total.masked_fill(~reliable, 0.0).amax(-1)  # [M]
    decided = (reach >= top_p + TOP_P_MARGIN) | (bound < 0)
    return ids, keep, decided


def _cut_top_p(scaled: torch.Tensor, top_p: torch.Tensor, support: Support | None,
               out: torch.Tensor | None = None) -> Support:
    """Set every token of ``scaled`` ``[N, V]`` outside its row's nucleus to -inf, in place,
    the nucleus taken over ``support`` (the top-k survivors) where a row has one. Returns the
    support after the cut (rows without a top-p cut keep ``support``'s); ``out`` ``[N, V]``,
    when given, holds the probabilities before the cut."""
    num_rows, vocab = scaled.shape
    dev = scaled.device
    rows = (top_p < 1.0).nonzero()[:, 0]
    sub = _rows(scaled, rows)  # [M, V]
    buffer = out if out is not None and sub is scaled else None
    probs = sub.softmax(-1) if buffer is None else torch.softmax(sub, -1, out=buffer)  # [M, V]
    p = top_p[rows]
    num = rows.numel()
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows of sub, their kept ids)
    pending = torch.ones(num, dtype=torch.bool, device=dev)
    levels: list[str] = ["groups", "candidates", "sort"]
    if support is not None and bool(support.rows[rows].any()):
        levels.insert(0, "support")
    for level in levels:
        if not bool(pending.any()):
            break
        r = pending.nonzero()[:, 0]
        if level == "support" and support is not None:
            r = (pending & support.rows[rows]).nonzero()[:, 0]
            cand = _rows(support.ids, rows[r])
            bound = torch.zeros(r.numel(), device=dev)  # outside the support: -inf, p 0
        elif level == "groups" and TOP_P_GROUPS * GROUP < vocab:
            cand, bound, _ = top_groups(_rows(probs, r), TOP_P_GROUPS)
        elif level == "candidates" and TOP_P_CANDIDATES < vocab:
            top = _rows(probs, r).topk(TOP_P_CANDIDATES, dim=-1)
            cand, bound = top.indices, top.values[:, -1]
        elif level == "sort":
            cand = torch.arange(vocab, device=dev).expand(r.numel(), -1)
            bound = torch.full((r.numel(),), -1.0, device=dev)
        else:
            continue
        ids, keep, decided = _nucleus(_rows(probs, r), cand, bound, p[r])
        if level == "support":
            # These rows are -inf outside their candidates already: only the candidates
            # the nucleus leaves out are cut.
            dropped = ids.masked_fill(keep | ~decided[:, None], vocab)
            dr, dc = (dropped < vocab).nonzero(as_tuple=True)
            sub[r[dr], dropped[dr, dc]] = float("-inf")
        else:
            # Every other token is cut: fill the rows, then put back what the nucleus keeps.
            done = r[decided]
            k_ids = ids[decided]
            kr, kc = keep[decided].nonzero(as_tuple=True)
            values = sub[done[kr], k_ids[kr, kc]]
            if done.numel() == sub.shape[0]:
                sub.fill_(float("-inf"))
            else:
                sub[done] = float("-inf")
            sub[done[kr], k_ids[kr, kc]] = values
        kept.append((r[decided], ids.masked_fill(~keep, vocab)[decided]))
        pending[r[decided]] = False
    if sub is not scaled:
        scaled[rows] = sub
    width = max(ids.shape[1] for _, ids in kept)
    nucleus = torch.full((num, width), vocab, dtype=torch.int64, device=dev)
    for r, ids in kept:
        nucleus[r, :ids.shape[1]] = ids
    nucleus = nucleus.sort(-1).values  # ascending ids, V padding last
    width = max(width, support.ids.shape[1] if support is not None else 0)
    support_ids = torch.full((num_rows, width), vocab, dtype=torch.int64, device=dev)
    has = torch.zeros(num_rows, dtype=torch.bool, device=dev)
    if support is not None:
        support_ids[:, :support.ids.shape[1]] = support.ids
        has |= support.rows
    support_ids[rows] = vocab
    support_ids[rows, :nucleus.shape[1]] = nucleus
    has[rows] = True
    return Support(support_ids, has)


def _cut_min_p(probs: torch.Tensor, min_p: torch.Tensor, support: Support | None) -> None:
    """Zero every probability of ``probs`` ``[N, V]`` below ``min_p`` ``[N]`` times its row's
    largest and renormalise the row, in place, on the rows whose ``min_p`` is above 0 (the
    others are left as they are, so a row's probabilities do not depend on its batch)."""
    vocab = probs.shape[-1]
    cut = min_p > 0
    has = cut & support.rows if support is not None else torch.zeros_like(cut)
    if support is not None and bool(has.any()):
        r = has.nonzero()[:, 0]
        ids = _rows(support.ids, r)  # [M, K]
        valid = ids < vocab
        safe = ids.clamp(max=vocab - 1)
        p = probs[r[:, None], safe].masked_fill(~valid, 0.0)
        # Only the support is nonzero: its largest is the row's, and so is its renormalised
        # row (every other entry stays 0, as 0 / sum is).
        floor = min_p[r, None] * p.amax(-1, keepdim=True)
        p.masked_fill_(p < floor, 0.0)
        rr, c = valid.nonzero(as_tuple=True)
        probs[r[rr], ids[rr, c]] = p[rr, c]
        total = _rows(probs, r).sum(-1, keepdim=True)  # the full row's sum, as dense does it
        probs[r[rr], ids[rr, c]] = p[rr, c] / total[rr, 0]
    dense = cut & ~has
    if bool(dense.any()):
        r = dense.nonzero()[:, 0]
        rows = probs[r]
        floor = min_p[r, None] * rows.amax(-1, keepdim=True)
        rows.masked_fill_(rows < floor, 0.0)
        probs[r] = rows.div_(rows.sum(-1, keepdim=True))
