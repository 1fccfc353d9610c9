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
from python_backends.gateway import tools
from python_backends.gateway.errors import ApiError, invalid

MAX_STOPS = 4  # OpenAI's limit
MAX_CHOICES = 16  # n and best_of, per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_PRIORITY = 9  # the server's priorities: 0 (default, last) .. 9 (first)
MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's limit); completions logprobs likewise
# Sampling fields passed to the ensemble under the same name, with their JSON type.
_SAMPLING: dict[str, type] = {"temperature": float, "top_p": float, "presence_penalty": float,
                              "frequency_penalty": float, "seed": int}
# vLLM's extra fields this server takes (docs/gateway.md lists what each maps to).
VLLM_FIELDS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
               "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
               "spaces_between_special_tokens", "priority", "stream_interval"}
# Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older names.
GUIDE_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
_COMMON = {"model", "stream", "stream_options", "stop", "max_tokens", "n", "user", "cache_salt",
           "logprobs", "logit_bias", *_SAMPLING, *VLLM_FIELDS, *GUIDE_FIELDS}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | TOOL_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
# Fields OpenAI defines that this server cannot honour (refused by name, with why).
_UNSUPPORTED = {
    "functions": "function calls are not supported: use tools",
    "function_call": "function calls are not supported: use tool_choice",
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
    # completions: the prompts, each text or token ids; chat: set from `messages` by the template
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stops: list[str] = field(default_factory=list)
    # ensemble inputs of the sampling fields (their names and values as the ensemble takes them)
    sampling: dict[str, Any] = field(default_factory=dict)
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # choices generated per prompt (the n likeliest are returned)
    echo: bool = False  # completions: the prompt's text begins each choice's text
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, with logprobs
    user: str | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False  # generate until max_tokens, whatever the end token
    include_stop: bool = False  # a matched stop string ends the text (vLLM's include_stop_str)
    # Structured output: (guided_decoding_guide_type, guided_decoding_guide), or None.
    guide: tuple[str, str] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # the functions, as given
    # "none", "auto", "required", or the name of the function that must be called
    tool_choice: str = "none"
    parallel_tool_calls: bool = True  # tool_choice required: one call or more


def parse_completion(body: Any) -> Generation:
    raw = _object(body, COMPLETION_FIELDS)
    gen = _common(raw, chat=False)
    gen.prompts = _prompts(raw.get("prompt"))
    gen.echo = _bool("echo", raw.get("echo", False))
    if raw.get("best_of") is not None:
        gen.best_of = _int("best_of", raw["best_of"], lo=1)
        if gen.best_of < gen.n:
            raise invalid("best_of", f"must be at least n ({gen.n}), got {gen.best_of}")
        if gen.best_of > MAX_CHOICES:
            raise invalid("best_of", f"at most {MAX_CHOICES}")
        if gen.best_of > gen.n and gen.stream:
            raise invalid("best_of", "a stream cannot choose among choices: use best_of = n")
    else:
        gen.best_of = gen.n
    if raw.get("suffix") is not None:
        raise invalid("suffix", "insertion is not supported")
    logprobs = raw.get("logprobs")
    if logprobs is not None:
        gen.top_logprobs = _int("logprobs", logprobs, lo=0)
        if gen.top_logprobs > MAX_TOP_LOGPROBS:
            raise invalid("logprobs", f"at most {MAX_TOP_LOGPROBS}")
        gen.logprobs = True
        if gen.echo:
            raise invalid("echo", "the prompt's log-probabilities are not computed: echo "
                          "without logprobs")
    return gen


def parse_chat(body: Any) -> Generation:
    raw = _object(body, CHAT_FIELDS)
    gen = _common(raw, chat=True)
    gen.best_of = gen.n
    gen.tools = tools.parse_tools(raw.get("tools"))
    gen.tool_choice = tools.parse_tool_choice(raw.get("tool_choice"), gen.tools)
    if raw.get("parallel_tool_calls") is not None:
        gen.parallel_tool_calls = _bool("parallel_tool_calls", raw["parallel_tool_calls"])
    if gen.tool_choice not in ("none", "auto"):
        if gen.guide is not None:
            raise invalid("tool_choice", "a required tool call is itself a structured output:"
                          " it cannot be combined with response_format or structured_outputs")
        gen.guide = _compiled("tools", "a function's parameters are not a schema the output "
                              "can follow", ("ebnf_grammar", tools.call_grammar(
                                  gen.tools, gen.tool_choice, gen.parallel_tool_calls)))
    gen.messages = _messages(raw.get("messages"))
    if raw.get("max_completion_tokens") is not None:
        gen.max_tokens = _int("max_completion_tokens", raw["max_completion_tokens"], lo=1)
    logprobs = raw.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("logprobs", f"expected a boolean, got {logprobs!r}")
    gen.logprobs = bool(logprobs)
    top = raw.get("top_logprobs")
    if top is not None:
        gen.top_logprobs = _int("top_logprobs", top, lo=0)
        if gen.top_logprobs > MAX_TOP_LOGPROBS:
            raise invalid("top_logprobs", f"at most {MAX_TOP_LOGPROBS}")
        if gen.top_logprobs and not gen.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
    return gen


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: a string, a list of strings, token ids, lists of them."""
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid("prompt", "a string, a list of strings, a list of token ids, or a list "
                      "of such lists")
    if len(prompts) > MAX_PROMPTS:
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request")
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not p:
            raise invalid(where, "must not be empty")
        if isinstance(p, list) and min(p) < 0:
            raise invalid(where, f"token id {min(p)} is not in the vocabulary")
    return prompts


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


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
    if raw.get("n") is not None:
        gen.n = _int("n", raw["n"], lo=1)
        if gen.n > MAX_CHOICES:
            raise invalid("n", f"at most {MAX_CHOICES}")
    gen.stops = _stops(raw.get("stop"))
    for name, kind in _SAMPLING.items():
        if raw.get(name) is not None:
            gen.sampling[name] = (_int(name, raw[name], lo=0) if kind is int
                                  else _number(name, raw[name]))
    if raw.get("user") is not None:
        gen.user = _text("user", raw["user"])
    if raw.get("cache_salt") is not None:
        gen.cache_salt = _text("cache_salt", raw["cache_salt"])
    if raw.get("logit_bias") is not None:
        gen.sampling["logit_bias"] = json.dumps(_logit_bias(raw["logit_bias"]))
    _vllm_fields(raw, gen)
    gen.guide = _guide(raw)
    return gen


def _logit_bias(value: Any) -> dict[str, float]:
    """OpenAI's logit_bias: token id (a JSON key) -> a bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise invalid("logit_bias", "an object of token id -> bias")
    out = {}
    for key, bias in value.items():
        if not str(key).isdigit():
            raise invalid("logit_bias", f"key {key!r} is not a token id")
        if not -100 <= _number(f"logit_bias.{key}", bias) <= 100:
            raise invalid(f"logit_bias.{key}", f"must be in [-100, 100], got {bias}")
        out[str(int(key))] = float(bias)
    return out


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
                "json", "regex", "choice", "grammar", "structural_tag"):
            raise invalid(name, "one of json, regex, choice, grammar or structural_tag")
        kind, inner = next(iter(value.items()))
        where, guide = f"{name}.{kind}", _vllm_guide(f"{name}.{kind}", kind, inner)
    else:
        where, guide = name, _vllm_guide(name, name.removeprefix("guided_"), value)
    if guide is None:
        return None
    return _compiled(where, f"not a valid {guide[0].replace('_', ' ')}", guide)


def _compiled(where: str, why: str, guide: tuple[str, str]) -> tuple[str, str]:
    """`guide`, once it compiles (guides.grammar: cached); a 400 naming `where` if not."""
    try:
        guides.grammar(*guide)
    except guides.InvalidGuide as e:
        raise invalid(where, f"{why}: {e}") from None
    return guide


def _response_format(value: Any) -> tuple[str, tuple[str, str] | None]:
    if not isinstance(value, dict) or value.get("type") not in (
            "text", "json_object", "json_schema", "structural_tag"):
        raise invalid("response_format", "an object whose type is text, json_object, "
                      "json_schema or structural_tag")
    if value["type"] == "text":
        return "response_format", None
    if value["type"] == "structural_tag":  # vLLM's: {"type", "structures", "triggers"}
        tag = {k: v for k, v in value.items() if k != "type"}
        return "response_format", ("structural_tag", json.dumps(tag))
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
    if kind == "structural_tag" and isinstance(value, dict):
        return "structural_tag", json.dumps(value)
    if not isinstance(value, str) or not value:
        raise invalid(where, "a non-empty string")
    return {"regex": "regex", "grammar": "ebnf_grammar"}.get(kind, kind), value


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
    if raw.get("min_p") is not None and (min_p := _number("min_p", raw["min_p"])):
        gen.sampling["min_p"] = min_p  # 0 is off, the server's default
    stop_ids = raw.get("stop_token_ids")
    if stop_ids is not None:
        if stop_ids != [] and not _is_ids(stop_ids):
            raise invalid("stop_token_ids", "expected a list of token ids")
        if stop_ids:
            gen.sampling["stop_token_ids"] = stop_ids
    if raw.get("priority") is not None:
        # vLLM: lower is earlier, 0 the default; here 0 (the default) .. 9, higher first
        priority = _int("priority", raw["priority"], lo=-MAX_PRIORITY)
        if priority > 0:
            raise invalid("priority", f"0 (the default) is the lowest priority here: use "
                          f"-{MAX_PRIORITY} (first) .. 0")
        if priority:
            gen.sampling["priority"] = -priority
    if raw.get("stream_interval") is not None:  # the server's may be larger (as vLLM's)
        gen.sampling["stream_interval"] = _int("stream_interval", raw["stream_interval"], lo=1)
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


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "a non-empty list of messages is required")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                            "assistant", "tool"):
            raise invalid(where, "each message needs a role: system, developer, user, "
                          "assistant or tool")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise invalid(f"{where}.content", "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str) and not (
                content is None and m["role"] == "assistant" and m.get("tool_calls")):
            raise invalid(f"{where}.content", "expected a string or a list of text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append(tools.parse_message(where, {**m, "role": role}, content))
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

