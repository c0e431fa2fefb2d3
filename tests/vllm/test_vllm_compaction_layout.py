"""The block layout a compaction writes (``kvcert.vllm.handoff.compaction_targets``, the worker's) and the one
the scheduler frees by (``compaction_layout``) agree, for every prompt size, cached prefix and compaction size.

For a request whose prompt fills ``n_full`` blocks (plus a partly filled one), that read ``c`` cached blocks and
holds ``c`` reserved blocks for them, and whose compaction takes m blocks (1 <= m <= every block):

- the compaction writes only the request's own blocks (its computed prompt blocks and the reserved ones),
  never a cached block;
- after the scheduler places the reserved blocks at the head of the block table, the blocks it frees
  (``range(used, intact)``) hold no compacted block, and the blocks it keeps are exactly the compacted ones
  among the full prompt blocks;
- the blocks ``c .. intact - 1``, which the scheduler registers in the prefix cache, were not written.

Negative control: a layout that frees one block more (``intact + 1``) frees a compacted block.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def _cases(draw):
    n_full = draw(st.integers(1, 40))
    partial = draw(st.booleans())
    c = draw(st.integers(0, n_full - 1))  # a hit always leaves at least the event's queries to compute
    m = draw(st.integers(1, n_full + int(partial)))
    return n_full, partial, c, m


def _layout(n_full, partial, c, m, slack=0):
    from kvcert.vllm.handoff import compaction_layout, compaction_targets

    nbt = n_full + int(partial)
    table = torch.arange(100, 100 + nbt)  # physical ids of the block table: cached ones 100 .. 100 + c - 1
    reserved = list(range(500, 500 + c))
    written = set(compaction_targets(table, n_full, reserved)[:m].tolist())
    used, intact = compaction_layout(n_full, c, m)
    intact += slack
    # the block table after the event: the reserved blocks stand in for the cached ones
    after = reserved + table[c:].tolist()
    freed = {after[j] for j in range(used, min(intact, n_full))}
    return table, reserved, written, used, intact, after, freed


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_the_scheduler_frees_what_the_worker_did_not_write(case):
    n_full, partial, c, m = case
    table, reserved, written, used, intact, after, freed = _layout(n_full, partial, c, m)
    assert len(written) == m  # m distinct blocks
    assert not written & set(table[:c].tolist())  # never a cached block
    assert written <= set(reserved) | set(table[c:].tolist())
    assert not freed & written  # nothing compacted is freed
    kept_full = set(after[:n_full]) - freed
    assert kept_full == written & set(after[:n_full])  # and every other full prompt block is
    assert c <= intact <= n_full and 0 <= used <= c
    assert not set(table[c:intact].tolist()) & written  # the blocks registered were not written


def test_negative_control_a_layout_freeing_one_block_more_frees_a_compacted_block():
    cases = hits = 0
    for n_full in range(1, 12):
        for c in range(n_full):
            for m in range(1, n_full - c + 1):  # compactions into the request's own computed blocks
                *_, written, used, intact, after, freed = _layout(n_full, False, c, m, slack=1)
                cases += 1
                hits += bool(freed & written)
    assert cases > 0 and hits == cases
