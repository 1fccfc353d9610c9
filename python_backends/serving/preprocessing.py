"""`preprocessing`: validate ensemble inputs, tokenize; hands a TokenizedRequest to the front."""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import AutoTokenizer

from python_backends.config import FAULT_INJECTION_ENV, EngineConfig
from python_backends.diagnostics import set_up_process
from python_backends.front.validation import InvalidRequest, parse_request
from python_backends.serving.common import (
    ModelArgs,
    engine_path,
    error_response,
    inputs_of,
    response,
)
from python_backends.serving.options import TokenizerOptions
from python_backends.wire import TokenizedRequest


class PreprocessingModel:
    def initialize(self, args: dict[str, str]) -> None:
        margs = ModelArgs(args)
        set_up_process(margs.instance_name)
        engine_dir = engine_path(margs.options(TokenizerOptions).engine_dir)
        self.config = EngineConfig.load(engine_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(engine_dir))
        self.faults_allowed = os.environ.get(FAULT_INJECTION_ENV) == "1"

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                req = parse_request(
                    inputs_of(request), json.loads(request.parameters() or "{}"),
                    self._tokenize, self.config.limits,
                    self.config.tokenizer.eos_token_ids, self.config.model.vocab_size,
                    self.faults_allowed,
                )
            except InvalidRequest as e:
                responses.append(error_response(str(e)))
                continue
            responses.append(response(TokenizedRequest(req), batched=True))
        return responses
