"""Coalescing of byte ranges: merged spans cover exactly the requested bytes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from raydcp.storage._ranges import plan_ranges

ranges_strategy = st.lists(
    st.tuples(st.integers(0, 300), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])), max_size=60
)


@settings(max_examples=300, deadline=None)
@given(ranges_strategy)
def test_spans_cover_exactly_the_requested_bytes(ranges):
    plan = plan_ranges(ranges, "f")

    requested = {b for s, e in ranges for b in range(s, e)}
    covered = [b for s, e in plan.spans for b in range(s, e)]
    assert sorted(covered) == sorted(requested)  # nothing unrequested, nothing twice
    assert all(a[1] < b[0] for a, b in zip(plan.spans, plan.spans[1:]))  # sorted, gap between spans

    data = bytes(i % 251 for i in range(400))
    views = plan.slices([data[s:e] for s, e in plan.spans])
    assert [bytes(v) for v in views] == [data[s:e] for s, e in ranges]
