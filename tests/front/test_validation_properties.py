"""Property-based bad input at the edge: whatever tensors and parameters arrive (types, shapes,
sizes, unicode, unknown names), parsing gives a valid request or an InvalidRequest naming a
field, never another exception."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from python_backends.front.validation import KNOWN_INPUTS, InvalidRequest, parse_request
from python_backends.wire import GenerationRequest
from tests.front.test_validation import LIMITS, tokenize

NAMES = st.sampled_from(sorted(KNOWN_INPUTS)) | st.text(min_size=1, max_size=12)
SCALARS = (st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.booleans()
           | st.text(max_size=40) | st.binary(max_size=40))
DTYPES = st.sampled_from([np.int32, np.int64, np.uint64, np.float32, np.float64, np.bool_,
                          np.object_])


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    """An array of any common dtype and a small shape, filled with any values it can hold."""
    shape = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    dtype = draw(DTYPES)
    values = draw(st.lists(SCALARS, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    try:
        with warnings.catch_warnings():  # numpy's notices about out-of-range values
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.array(values, dtype=dtype).reshape(shape)
    except (ValueError, TypeError, OverflowError):
        return np.zeros(shape, dtype=dtype)


@st.composite
def requests(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    inputs = draw(st.dictionaries(NAMES, arrays(), max_size=6))
    if draw(st.booleans()):  # most requests carry a prompt, valid or not
        text = draw(st.text(max_size=80) | st.binary(max_size=80))
        inputs["text_input"] = np.array([[text]], dtype=np.object_)
    parameters = draw(st.dictionaries(NAMES, SCALARS, max_size=3))
    return inputs, parameters


@settings(max_examples=2000, deadline=None)
@given(requests())
def test_any_input_is_a_request_or_an_error_naming_a_field(
    request: tuple[dict[str, np.ndarray], dict[str, Any]]
) -> None:
    inputs, parameters = request
    try:
        parsed = parse_request(inputs, parameters, tokenize, LIMITS, (2,))
    except InvalidRequest as e:
        assert e.field and f"'{e.field}'" in str(e)
        return
    assert isinstance(parsed, GenerationRequest) and parsed.prompt_ids
    assert 0 < len(parsed.prompt_ids) + parsed.params.max_tokens <= LIMITS.max_seq_len
