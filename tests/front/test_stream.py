from python_backends.front.stream import RequestStream


def test_non_streaming_sends_one_chunk_with_prompt_unless_excluded() -> None:
    s = RequestStream([5, 6], stream=False, exclude_input_in_output=False, return_log_probs=True)
    assert s.add([7], [-0.5], "") is None
    c = s.add([8], [-0.25], "stop")
    assert c is not None
    assert c.tokens == [5, 6, 7, 8] and c.prefix_len == 0 and c.finish_reason == "stop"
    assert (c.num_input_tokens, c.num_output_tokens) == (2, 2)
    assert c.cum_log_prob == -0.75 and c.output_log_probs == [-0.5, -0.25]
    ex = RequestStream([5, 6], stream=False, exclude_input_in_output=True, return_log_probs=False)
    ex.add([7], [0.0], "")
    c = ex.add([8], [0.0], "length")
    assert c is not None and c.tokens == [7, 8] and c.output_log_probs == []


def test_streaming_windows_and_timing() -> None:
    s = RequestStream([1], stream=True, exclude_input_in_output=True, return_log_probs=True)
    chunks = [s.add([t], [-1.0], "") for t in range(20)]
    last = chunks[-1]
    assert last is not None and last.tokens == list(range(11, 20)) and last.prefix_len == 8
    assert last.output_ids == [19]
    assert last.output_log_probs == [-1.0]
    assert s.ttft is not None and s.tpot is not None
    final = s.add([], [], "cancelled")
    assert final is not None and final.finish_reason == "cancelled" and final.tokens[8:] == []


def test_only_a_probe_reports_nothing() -> None:
    from python_backends.wire import ClientChunk

    probe = ClientChunk.probe("board", 257)
    assert probe.is_probe and (probe.cancel_board, probe.cancel_ticket) == ("board", 257)
    s = RequestStream([1], stream=True, exclude_input_in_output=True, return_log_probs=False)
    first = s.add([5], [0.0], "")
    last = s.add([], [], "stop")  # a final chunk may carry no new token, never no reason
    assert first is not None and last is not None
    assert not first.is_probe and not last.is_probe
    whole = RequestStream([1], stream=False, exclude_input_in_output=True,
                          return_log_probs=False).add([], [], "cancelled")
    assert whole is not None and not whole.is_probe


def test_resumed_tokens_are_context_and_counted_but_never_sent_again() -> None:
    s = RequestStream([1], stream=True, exclude_input_in_output=True, return_log_probs=False)
    s.resume([7, 8, 9])
    c = s.add([10], [-0.5], "")
    assert c is not None and c.output_ids == [10]
    assert c.tokens == [7, 8, 9, 10] and c.prefix_len == 3  # detokenized in context
    assert c.num_output_tokens == 4
