"""OpenAI's /v1/completions and /v1/chat/completions requests, read into one `Generation`.

Every field OpenAI defines is either served or refused by name: a client never has a field
silently ignored. So are the extra sampling fields of vLLM's OpenAI server, under vLLM's names
and meanings, which clients written for vLLM or SGLang send (vLLM's own benchmark client sends
`repetition_penalty` and `ignore_eos`). Sampling values are range-checked by the Triton server
(its messages name the same fields); the gateway checks types, and what only it understands
(prompt, messages, stop, n, stream_options, logprobs).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from python_backends import guides
from python_backends.gateway.errors import ApiError, invalid

MAX_STOPS = 4  # OpenAI's limit
# Sampling fields passed to the ensemble under the same name, with their JSON type.
_SAMPLING: dict[str, type] = {"temperature": float, "top_p": float, "presence_penalty": float,
                              "frequency_penalty": float, "seed": int}
# vLLM's extra fields this server takes (docs/gateway.md lists what each maps to).
VLLM_FIELDS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
               "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
               "spaces_between_special_tokens"}
# Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older names.
GUIDE_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar"}
_COMMON = {"model", "stream", "stream_options", "stop", "max_tokens", "n", "user", "cache_salt",
           "logprobs", *_SAMPLING, *VLLM_FIELDS, *GUIDE_FIELDS}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
# Fields OpenAI defines that this server cannot honour (refused by name, with why).
_UNSUPPORTED = {
    "logit_bias": "token biases are not supported",
    "tools": "tool calls are not supported", "tool_choice": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "parallel_tool_calls": "tool calls are not supported",
    "audio": "audio is not supported", "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model does not reason", "store": "responses are not stored",
    "metadata": "responses are not stored", "service_tier": "there is one service tier",
    "web_search_options": "web search is not supported",
}


@dataclass
class Generation:
    """What one OpenAI request asks of the ensemble."""

    model: str
    chat: bool
    prompt: str = ""  # the completion prompt (chat: set from `messages` by the template)
    messages: list[dict[str, str]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stops: list[str] = field(default_factory=list)
    sampling: dict[str, float | int] = field(default_factory=dict)
    logprobs: bool = False
    user: str | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False  # generate until max_tokens, whatever the end token
    include_stop: bool = False  # a matched stop string ends the text (vLLM's include_stop_str)
    # Structured output: (guided_decoding_guide_type, guided_decoding_guide), or None.
    guide: tuple[str, str] | None = None


def parse_completion(body: Any) -> Generation:
    raw = _object(body, COMPLETION_FIELDS)
    gen = _common(raw, chat=False)
    prompt = raw.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        raise invalid("prompt", "one prompt per request (a string); batches and token ids are "
                      "not supported")
    gen.prompt = _text("prompt", prompt)
    if raw.get("echo"):
        raise invalid("echo", "echoing the prompt is not supported")
    if raw.get("best_of") not in (None, 1):
        raise invalid("best_of", "only 1 is supported")
    if raw.get("suffix") is not None:
        raise invalid("suffix", "insertion is not supported")
    logprobs = raw.get("logprobs")
    if logprobs is not None:
        n = _int("logprobs", logprobs, lo=0)
        if n > 1:
            raise invalid("logprobs", "the engine gives the sampled token's log-probability "
                          "only: use 0 or 1")
        gen.logprobs = True
    return gen


def parse_chat(body: Any) -> Generation:
    raw = _object(body, CHAT_FIELDS)
    gen = _common(raw, chat=True)
    gen.messages = _messages(raw.get("messages"))
    if raw.get("max_completion_tokens") is not None:
        gen.max_tokens = _int("max_completion_tokens", raw["max_completion_tokens"], lo=1)
    logprobs = raw.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("logprobs", f"expected a boolean, got {logprobs!r}")
    gen.logprobs = bool(logprobs)
    top = raw.get("top_logprobs")
    if top is not None and _int("top_logprobs", top, lo=0) > 0:
        raise invalid("top_logprobs", "alternatives are not available: the engine gives the "
                      "sampled token's log-probability only (use logprobs: true)")
    return gen


def _object(body: Any, known: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in sorted(body):
        if name in _UNSUPPORTED and body[name] not in (None, [], {}):
            raise invalid(name, _UNSUPPORTED[name])
        if name not in known and name not in _UNSUPPORTED:
            raise invalid(name, "unknown field")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise invalid("model", "a model name is required (see /v1/models)")
    return body


def _common(raw: dict[str, Any], chat: bool) -> Generation:
    gen = Generation(model=raw["model"], chat=chat)
    gen.stream = _bool("stream", raw.get("stream", False))
    options = raw.get("stream_options")
    if options is not None:
        if not gen.stream:
            raise invalid("stream_options", "only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options", "only include_usage is supported")
        gen.include_usage = _bool("stream_options.include_usage",
                                  options.get("include_usage", False))
    if raw.get("max_tokens") is not None:
        gen.max_tokens = _int("max_tokens", raw["max_tokens"], lo=1)
    if raw.get("n") not in (None, 1):
        raise invalid("n", "only one choice per request is supported")
    gen.stops = _stops(raw.get("stop"))
    for name, kind in _SAMPLING.items():
        if raw.get(name) is not None:
            gen.sampling[name] = (_int(name, raw[name], lo=0) if kind is int
                                  else _number(name, raw[name]))
    if raw.get("user") is not None:
        gen.user = _text("user", raw["user"])
    if raw.get("cache_salt") is not None:
        gen.cache_salt = _text("cache_salt", raw["cache_salt"])
    _vllm_fields(raw, gen)
    gen.guide = _guide(raw)
    return gen


def _guide(raw: dict[str, Any]) -> tuple[str, str] | None:
    """The request's structured-output guide, compiled here (guides.grammar: cached) so that a
    schema or grammar that cannot be one is a 400 naming the field before any engine work."""
    given = [name for name in sorted(GUIDE_FIELDS) if raw.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise invalid(given[1], f"one structured output per request; {given[0]} gives one")
    name = given[0]
    value = raw[name]
    if name == "response_format":
        where, guide = _response_format(value)
    elif name == "structured_outputs":
        if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in (
                "json", "regex", "choice", "grammar"):
            raise invalid(name, "one of json, regex, choice or grammar")
        kind, inner = next(iter(value.items()))
        where, guide = f"{name}.{kind}", _vllm_guide(f"{name}.{kind}", kind, inner)
    else:
        where, guide = name, _vllm_guide(name, name.removeprefix("guided_"), value)
    if guide is None:
        return None
    try:
        guides.grammar(*guide)
    except guides.InvalidGuide as e:
        raise invalid(where, f"not a valid {guide[0].replace('_', ' ')}: {e}") from None
    return guide


def _response_format(value: Any) -> tuple[str, tuple[str, str] | None]:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object",
                                                                 "json_schema"):
        raise invalid("response_format", "an object whose type is text, json_object or "
                      "json_schema")
    if value["type"] == "text":
        return "response_format", None
    if value["type"] == "json_object":
        return "response_format", ("json", "")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise invalid("response_format.json_schema", "an object with a `schema` object")
    # strict or not, the output follows the schema: the engine cannot produce anything else
    return "response_format.json_schema.schema", ("json_schema",
                                                  json.dumps(spec.get("schema", {})))


def _vllm_guide(where: str, kind: str, value: Any) -> tuple[str, str]:
    if kind == "json":
        if isinstance(value, str):
            return "json_schema", value
        if isinstance(value, dict):
            return "json_schema", json.dumps(value)
        raise invalid(where, "a JSON schema (an object, or a string holding one)")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(
                isinstance(c, str) for c in value):
            raise invalid(where, "a non-empty list of strings")
        return "choice", json.dumps(value)
    if not isinstance(value, str) or not value:
        raise invalid(where, "a non-empty string")
    return ("regex", value) if kind == "regex" else ("ebnf_grammar", value)


def _vllm_fields(raw: dict[str, Any], gen: Generation) -> None:
    """vLLM's extra sampling fields, with vLLM's meanings (None is the default everywhere)."""
    if raw.get("top_k") is not None:
        top_k = _int("top_k", raw["top_k"], lo=-1)
        gen.sampling["top_k"] = max(top_k, 0)  # vLLM: -1 (or 0) keeps every token; here 0
    if raw.get("repetition_penalty") is not None:
        gen.sampling["repetition_penalty"] = _number("repetition_penalty",
                                                     raw["repetition_penalty"])
    if raw.get("min_tokens") is not None:
        gen.sampling["min_tokens"] = _int("min_tokens", raw["min_tokens"], lo=0)
    if raw.get("min_p") is not None and _number("min_p", raw["min_p"]) != 0:
        raise invalid("min_p", "min-p sampling is not supported: use 0 (off), or top_p")
    stop_ids = raw.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in stop_ids):
            raise invalid("stop_token_ids", "expected a list of token ids")
        if stop_ids:
            raise invalid("stop_token_ids", "stopping on token ids besides the end token is "
                          "not supported: use stop strings")
    if raw.get("ignore_eos") is not None:
        gen.ignore_eos = _bool("ignore_eos", raw["ignore_eos"])
    if raw.get("include_stop_str_in_output") is not None:
        gen.include_stop = _bool("include_stop_str_in_output",
                                 raw["include_stop_str_in_output"])
    if raw.get("skip_special_tokens") is not None and not _bool(
            "skip_special_tokens", raw["skip_special_tokens"]):
        raise invalid("skip_special_tokens", "special tokens are always left out of the text")
    if raw.get("spaces_between_special_tokens") is not None:
        # vLLM's default, true, is the only behaviour here; false changes nothing either, since
        # special tokens are never in the text
        _bool("spaces_between_special_tokens", raw["spaces_between_special_tokens"])


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "a non-empty list of messages is required")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                            "assistant"):
            raise invalid(where, "each message needs a role: system, developer, user or "
                          "assistant")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise invalid(f"{where}.content", "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", "expected a string or a list of text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise invalid("stop", f"at most {MAX_STOPS} stop sequences")
    return stops


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(name, f"expected a string, got {type(value).__name__}")
    if not value:
        raise invalid(name, "must not be empty")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(name, f"expected a boolean, got {value!r}")
    return value


def _int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"expected an integer, got {value!r}")
    if value < lo:
        raise invalid(name, f"must be >= {lo}, got {value}")
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(name, f"expected a finite number, got {value!r}")
    return float(value)

