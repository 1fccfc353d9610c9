"""The ensemble's input tensors, typed by the wire's declaration of each input."""

from __future__ import annotations

import pytest

from python_backends.gateway.errors import ApiError
from python_backends.gateway.triton import ensemble_inputs


def test_inputs_take_the_ensembles_types_and_shapes() -> None:
    tensors = {t.name(): t for t in ensemble_inputs(
        {"text_input": "Hi", "max_tokens": 3, "temperature": 0.5, "stream": True,
         "resume_ids": [5, 6, 7], "stop_words": ["a", "b"]})}
    assert {n: (t.datatype(), t.shape()) for n, t in tensors.items()} == {
        "text_input": ("BYTES", [1, 1]), "max_tokens": ("INT32", [1, 1]),
        "temperature": ("FP32", [1, 1]), "stream": ("BOOL", [1, 1]),
        "resume_ids": ("INT32", [1, 3]), "stop_words": ("BYTES", [1, 2])}


@pytest.mark.parametrize(("inputs", "field"), [
    ({"colour": "red"}, "colour"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"resume_ids": [1, "x"]}, "resume_ids"),
    ({"resume_ids": 3}, "resume_ids"),
    ({"resume_ids": [2**40]}, "resume_ids"),
])
def test_bad_values_are_refused_by_name(inputs: dict[str, object], field: str) -> None:
    with pytest.raises(ApiError) as e:
        ensemble_inputs(inputs)
    assert e.value.status == 400 and e.value.param == field
