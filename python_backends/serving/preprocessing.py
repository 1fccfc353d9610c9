"""`preprocessing`: validate ensemble inputs, tokenize; hands one JSON request to the scheduler."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from python_backends.config import EngineConfig
from python_backends.diagnostics import enable_stack_dumps
from python_backends.protocol import InvalidRequest, parse_request
from python_backends.serving.common import (
    ModelArgs,
    bytes_tensor,
    error_response,
    inputs_of,
    tensor,
)


class PreprocessingModel:
    def initialize(self, args: dict[str, str]) -> None:
        enable_stack_dumps()
        engine_dir = ModelArgs(args).engine_dir()
        self.config = EngineConfig.load(engine_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(engine_dir))

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                req = parse_request(
                    inputs_of(request), json.loads(request.parameters() or "{}"),
                    self._tokenize, self.config.limits,
                    self.config.tokenizer.eos_token_ids,
                )
            except InvalidRequest as e:
                responses.append(error_response(str(e)))
                continue
            responses.append(
                _response(np.array([req.prompt_ids], dtype=np.int32), req.to_json())
            )
        return responses


def _response(input_ids: np.ndarray, request_json: str) -> Any:
    return pb_utils.InferenceResponse(
        [tensor("INPUT_IDS", input_ids), bytes_tensor("REQUEST", [request_json])]
    )
