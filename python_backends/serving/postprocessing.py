"""`postprocessing`: a ClientChunk's token window to text (stateless; see
python_backends.detokenizer), answered as the ensemble's outputs. A probe chunk, or any chunk
of a client that went away, ends with no response (the client sees nothing)."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from python_backends.detokenizer import incremental_text
from python_backends.diagnostics import set_up_process
from python_backends.flag_board import BoardCache
from python_backends.serving.common import (
    FINAL,
    ModelArgs,
    engine_path,
    error_response,
    inputs_of,
    response,
)
from python_backends.serving.options import TokenizerOptions
from python_backends.wire import ClientChunk


class PostprocessingModel:
    def initialize(self, args: dict[str, str]) -> None:
        margs = ModelArgs(args)
        set_up_process(margs.instance_name)
        engine_dir = engine_path(margs.options(TokenizerOptions).engine_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(engine_dir))
        self.boards = BoardCache()

    def finalize(self) -> None:
        self.boards.close()

    def execute(self, requests: list[Any]) -> None:
        # Decoupled, so that a request can end with no response at all: the ensemble then sends
        # its client nothing. (A response with no outputs would still reach the client, as an
        # empty one, and an error would stop the 2.51 ensemble counting its steps; see
        # docs/platform.md.)
        for request in requests:
            sender = request.get_response_sender()
            try:
                chunk = ClientChunk.decode(inputs_of(request))
            except Exception as e:  # a bug in the front: answer it, keep serving
                sender.send(error_response(f"postprocessing: bad chunk: {e}"), flags=FINAL)
                continue
            # Asked once a chunk: each ask is a round trip to tritonserver.
            cancelled = request.is_cancelled()
            if cancelled:
                # The ensemble marks this step's request when the client went away; tell the
                # front and the engine through the cancel board (see flag_board).
                self.boards.get(chunk.cancel_board).cancel(chunk.cancel_ticket)
            if cancelled or chunk.is_probe:
                sender.send(flags=FINAL)
                continue
            text = incremental_text(self.tokenizer, chunk.tokens, chunk.prefix_len)
            sender.send(response(chunk.output(text), batched=True), flags=FINAL)
        return None
