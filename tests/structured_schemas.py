"""Hypothesis strategies for JSON schemas whose every output is short (bounded integers, numbers and arrays, strings
by pattern or enum), so that a random-weights model completes them within a few dozen tokens; shared by the engine
and server tests of structured outputs."""

from __future__ import annotations

from hypothesis import strategies as st

NAMES = st.sampled_from(["a", "b", "name", "age", "tags", "ok", "x_1"])
SCALARS = st.one_of(st.integers(-20, 20), st.booleans(), st.none(), st.sampled_from(["red", "green", "a b"]))


@st.composite
def _integer(draw):
    low = draw(st.integers(-30, 30))
    return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 40))}


LEAVES = st.one_of(
    _integer(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.just({"type": "number", "minimum": 0, "maximum": 5}),
    st.sampled_from(["^[a-z]{1,4}$", "^[A-Z][a-z]{0,3}$", "^[0-9]{2}$"]).map(lambda p: {"type": "string",
                                                                                       "pattern": p}),
    st.lists(SCALARS, min_size=1, max_size=4, unique_by=repr).map(lambda values: {"enum": values}),
)


@st.composite
def _object(draw, children):
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    properties = {name: draw(children) for name in names}
    required = [name for name in names if draw(st.booleans())]
    return {"type": "object", "properties": properties, "required": required}


@st.composite
def _array(draw, children):
    most = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(children), "minItems": draw(st.integers(0, most)), "maxItems": most}


def json_schemas():
    """Objects (with required fields), arrays, enums and bounded scalars, nested up to a few levels; the root is an
    object, as the schemas of tool calls and extraction are."""
    nested = st.recursive(LEAVES, lambda children: st.one_of(_object(children), _array(children)), max_leaves=4)
    return _object(nested)
