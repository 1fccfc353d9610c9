"""`postprocessing`: token-id windows to text (stateless; see python_backends.detokenizer)."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from python_backends.cancel_board import BoardCache
from python_backends.detokenizer import incremental_text
from python_backends.diagnostics import enable_stack_dumps
from python_backends.serving.common import (
    ModelArgs,
    bytes_tensor,
    cancel_target,
    error_response,
    first,
    first_bytes,
    inputs_of,
    tensor,
)

PASS_THROUGH = {
    "OUTPUT_IDS": "output_ids",
    "NUM_INPUT_TOKENS": "num_input_tokens",
    "NUM_OUTPUT_TOKENS": "num_output_tokens",
    "CUM_LOG_PROBS": "cum_log_probs",
    "OUTPUT_LOG_PROBS": "output_log_probs",
}


class PostprocessingModel:
    def initialize(self, args: dict[str, str]) -> None:
        enable_stack_dumps()
        self.tokenizer = AutoTokenizer.from_pretrained(str(ModelArgs(args).engine_dir()))
        self.boards = BoardCache()

    def finalize(self) -> None:
        self.boards.close()

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            inputs = inputs_of(request)
            if request.is_cancelled():
                # The ensemble marks this step's request when the client went away; tell the
                # scheduler and the engine through the cancel board (see cancel_board).
                board, ticket = cancel_target(inputs, self.boards)
                board.cancel(ticket)
                responses.append(error_response("cancelled", pb_utils.TritonError.CANCELLED))
                continue
            tokens = inputs["TOKENS"].reshape(-1).tolist()
            prefix_len = int(first(inputs, "PREFIX_LEN"))
            text = incremental_text(self.tokenizer, tokens, prefix_len)
            outputs = [
                bytes_tensor("text_output", [text]),
                bytes_tensor("finish_reason", [first_bytes(inputs, "FINISH_REASON")]),
            ]
            outputs += [tensor(out, np.ascontiguousarray(inputs[name]))
                        for name, out in PASS_THROUGH.items()]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
