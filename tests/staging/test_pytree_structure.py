"""The stage's per-item structure check (torch_stage.staging._pytree) against torch's
own pytree: its fast signature must say "same structure" exactly when
``pytree.tree_flatten`` gives equal specs and tensor positions, over random
nestings of the containers pytree knows (and one it knows only by
registration), leaves of every kind, and small mutations of each.
"""

import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_stage.staging import _pytree

Point = collections.namedtuple("Point", "x y")
Other = collections.namedtuple("Other", "x y")  # same fields, another type

leaves = st.sampled_from(
    [torch.zeros(1), torch.ones(2, dtype=torch.int64), 0, 1, 1.0, True, None, "a", b"b"]
)


def containers(children):
    keys = st.sampled_from(["a", "b", "c", 1])
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(keys, children, max_size=3).map(collections.OrderedDict),
        st.tuples(children, children).map(lambda xy: Point(*xy)),
        st.tuples(children, children).map(lambda xy: Other(*xy)),
    )


trees = st.recursive(leaves, containers, max_leaves=12)


def same_by_pytree(a, b):
    return _pytree.structure(a) == _pytree.structure(b)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees, trees)
def test_signature_agrees_with_pytree(a, b):
    sig_a, sig_b = [], []
    if _pytree._signature(a, sig_a) and _pytree._signature(b, sig_b):
        assert (sig_a == sig_b) == same_by_pytree(a, b), (a, b)
    checker = _pytree.StructureChecker()
    checker(a, 0)
    checker(a, 1)  # the first item's own structure always passes
    if same_by_pytree(a, b):
        checker(b, 2)
    else:
        with pytest.raises(ValueError, match="different structure for item 2"):
            checker(b, 2)


def test_signature_decides_the_usual_items_and_defers_registered_types():
    parsed = {"label": torch.zeros(4), "ids": Point(torch.zeros(3), torch.zeros(5))}
    assert _pytree._signature(parsed, [])
    assert _pytree._signature([(torch.zeros(1), 3, None, "s")], [])
    # OrderedDict is a registered node whose flatten this mirror does not
    # copy: the full structure decides.
    assert not _pytree._signature({"a": collections.OrderedDict(b=1)}, [])


@pytest.mark.parametrize(
    "first, later",
    [
        ({"a": torch.zeros(1), "b": 1}, {"b": 1, "a": torch.zeros(1)}),  # key order
        ({"a": torch.zeros(1)}, {"a": 1}),  # a tensor became a number
        (Point(torch.zeros(1), 1), Other(torch.zeros(1), 1)),  # namedtuple type
        ((torch.zeros(1),), [torch.zeros(1)]),  # tuple against list
        ([torch.zeros(1), None], [torch.zeros(1)]),  # length
    ],
)
def test_every_difference_pytree_sees_is_an_error(first, later):
    checker = _pytree.StructureChecker()
    checker(first, 0)
    with pytest.raises(ValueError, match="different structure for item 5"):
        checker(later, 5)
