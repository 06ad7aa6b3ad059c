"""Property: any nested state of supported leaves survives save -> load exactly."""

from __future__ import annotations

import itertools
import math
import string

import pytest
import torch

pytest.importorskip("hypothesis", reason="the property-based tests need hypothesis "
                    "(pip install -e '.[test]')")
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ckptio
from conftest import ALL_DTYPES
from special_values import rand

DTYPES = ALL_DTYPES

SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)


def make_view(dtype, shape, seed, how) -> torch.Tensor:
    """A tensor of ``shape`` laid out as ``how`` says (views share a larger or smaller storage)."""
    nd = len(shape)
    if how == "transpose" and nd >= 2:
        return rand(dtype, shape[::-1], seed).permute(*reversed(range(nd)))
    if how == "step" and nd >= 1:
        base = rand(dtype, tuple(2 * s + 1 for s in shape), seed)
        return base[tuple(slice(1, 2 * s + 1, 2) for s in shape)]
    if how == "expand" and nd >= 1:
        return rand(dtype, (1, *shape[1:]), seed).expand(*shape)
    if how == "narrow":
        n = math.prod(shape)
        return rand(dtype, (n + 37,), seed)[37:].view(shape)
    return rand(dtype, shape, seed)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    how = draw(st.sampled_from(["plain", "transpose", "step", "expand", "narrow"]))
    return make_view(dtype, shape, draw(st.integers(0, 2**31 - 1)), how)


@st.composite
def big_tensors(draw):
    """Larger than one 1 MiB staging buffer, and usually non-contiguous."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.complex64, torch.int16]))
    rows, cols = draw(st.integers(400, 800)), draw(st.integers(700, 900))
    how = draw(st.sampled_from(["transpose", "step", "plain"]))
    return make_view(dtype, (rows, cols), draw(st.integers(0, 2**31 - 1)), how)


floats = st.one_of(
    st.floats(allow_nan=False),
    st.sampled_from([float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 5e-324]),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**200), 2**200), floats,
    st.complex_numbers(allow_nan=False), st.just(complex(float("nan"), -0.0)),
    st.text(max_size=12), st.binary(max_size=40),
)
leaves = st.one_of(tensors(), tensors(), scalars)
keys = st.one_of(st.text(string.ascii_letters + string.digits + "_-é", min_size=1, max_size=6),
                 st.integers(-3, 50))


def _distinct_text(d: dict) -> bool:
    return len({str(k) for k in d}) == len(d)  # {1: .., "1": ..} would share one dotted key


def containers(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=4).filter(_distinct_text),
    )


trees = st.recursive(leaves, containers, max_leaves=14)


@st.composite
def states(draw):
    root = draw(st.dictionaries(keys, trees, min_size=1, max_size=6).filter(_distinct_text))
    if draw(st.sampled_from(["big", "big", "small"])) == "big":
        root = {"big": draw(big_tensors()), "rest": root}
    if draw(st.integers(0, 4)) == 0:
        root = [root, draw(trees)]
    return root


_counter = itertools.count()


@SETTINGS
@given(state=states())
def test_fresh_load_equals_saved_state(state, tmp_path, small_options, assert_same):
    path = tmp_path / f"c{next(_counter)}"
    ckptio.save(state, path, options=small_options)
    assert_same(ckptio.load(path), state)


def _blank(value, seed: int):
    """A destination of the same structure: other tensor bits, placeholder Python values (in
    tuples too: a load rebuilds a tuple in its parent with the saved values)."""
    if isinstance(value, torch.Tensor):
        return rand(value.dtype, tuple(value.shape), seed)  # its own storage, not aliased
    if isinstance(value, dict):
        return {k: _blank(v, seed + i) for i, (k, v) in enumerate(value.items())}
    if isinstance(value, list):
        return [_blank(v, seed + i) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_blank(v, seed + i) for i, v in enumerate(value))
    return "placeholder"


@SETTINGS
@given(state=states())
# bytes (and other values) inside tuples, nested: once excluded here as a known failure
@example(state={"t": (b"ab", 1, torch.ones(2)), "n": [(b"", ("x", b"\x00", 2.5))]})
def test_in_place_load_restores_saved_state(state, tmp_path, small_options, assert_same):
    path = tmp_path / f"i{next(_counter)}"
    ckptio.save(state, path, options=small_options)
    dest = _blank(state, 7)
    ckptio.load(path, dest)
    # expanded tensors were loaded into contiguous destinations: compare values, not layouts
    assert_same(dest, state)


@pytest.mark.parametrize("how", ["plain", "transpose", "step", "expand", "narrow"])
def test_view_builder_makes_the_layout_it_names(how):
    t = make_view(torch.float32, (3, 4, 5), 0, how)
    assert t.shape == (3, 4, 5)
    assert t.is_contiguous() == (how in ("plain", "narrow"))
    if how == "narrow":
        assert t.storage_offset() == 37
