"""The client-facing request: ensemble inputs (TensorRT-LLM backend names) parsed and validated
at the edge into a `GenerationRequest`, with errors that name the offending field.

Inputs arrive as numpy arrays with a leading batch dimension of 1 (the ensemble batches like the
TensorRT-LLM one, so existing clients send the shapes they already send).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from python_backends import guides
from python_backends.config import FAULT_INJECTION_ENV, EngineLimits
from python_backends.guides import GUIDE_TYPES
from python_backends.kv_transfer import TRANSPORTS
from python_backends.params import SamplingParams
from python_backends.wire import CLIENT_INPUTS, DEFAULT_TENANT, GenerationRequest, Kind

DEFAULT_MAX_TOKENS = 64
MAX_TOP_LOG_PROBS = 20  # OpenAI's top_logprobs limit
MAX_CHARS_PER_TOKEN = 64  # generous: real text averages 3-5


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid input '{field}': {message}")
        self.field = field


# The optional scalar inputs and how each is read; the kinds decide the accepted numpy dtypes.
_INT, _FLOAT, _BOOL = "int", "float", "bool"
_KINDS = {Kind.INT: _INT, Kind.UINT64: _INT, Kind.FLOAT: _FLOAT, Kind.BOOL: _BOOL}
SCALAR_INPUTS: dict[str, str] = {name: _KINDS[spec.kind] for name, spec in CLIENT_INPUTS.items()
                                 if spec.kind in _KINDS}
MAX_PRIORITY = 9  # priorities are 0 (default, lowest) .. 9
KNOWN_INPUTS = frozenset(CLIENT_INPUTS)
# Request parameters (HTTP /generate turns unknown top-level JSON keys into parameters): those
# Triton itself sets pass; any other is a client mistake such as a misspelt input name.
TRITON_PARAMETERS = frozenset(("sequence_id", "sequence_start", "sequence_end"))
TRITON_PARAMETER_PREFIX = "triton_"
# The tenant (for rate limits) comes as the request parameter `tenant` (a top-level key of a
# /generate body), or as gRPC metadata x-tenant, which the launcher has Triton forward.
TENANT_PARAMETERS = ("tenant", "x-tenant")
MAX_TENANT_LEN = 64
MAX_CACHE_SALT_LEN = 256
# Routing parameters for operators, drills and tests. `route`: "auto" lets the front choose
# (disaggregate long prompts while the prefill group has room), "aggregated" and
# "disaggregated" force a path. `kv_transport` picks the handoff transport. `kv_fault` injects a
# handoff failure: "transfer_error" (the pull fails) or "expire_lease" (the lease is already over
# when the decode instance pulls); either way decode recomputes the prompt. `engine_fault`
# "error_after_first_token" makes the worker or decode instance fail the sequence right after its
# first token (error handling drills).
ROUTES = ("auto", "aggregated", "disaggregated")
KV_TRANSPORTS = TRANSPORTS
KV_FAULTS = ("transfer_error", "expire_lease")
ENGINE_FAULTS = ("error_after_first_token",)
# refused unless the server allows faults (config.FAULT_INJECTION_ENV)
FAULT_PARAMETERS = {"kv_fault": KV_FAULTS, "engine_fault": ENGINE_FAULTS}
ROUTING_PARAMETERS = {"route": ROUTES, "kv_transport": KV_TRANSPORTS, **FAULT_PARAMETERS}

# (text, add_special_tokens) -> token ids
Tokenize = Callable[[str, bool], list[int]]


def _scalar(name: str, kind: str, arr: np.ndarray) -> Any:
    if arr.size != 1:
        raise InvalidRequest(name, f"expected one value, got {arr.size}")
    value = arr.reshape(-1)[0]
    if kind == _BOOL:
        if arr.dtype != np.bool_:
            raise InvalidRequest(name, f"expected BOOL, got {arr.dtype}")
        return bool(value)
    if kind == _INT:
        if not np.issubdtype(arr.dtype, np.integer):
            raise InvalidRequest(name, f"expected an integer type, got {arr.dtype}")
        return int(value)
    if not np.issubdtype(arr.dtype, np.floating):
        raise InvalidRequest(name, f"expected a floating-point type, got {arr.dtype}")
    f = float(value)
    if not math.isfinite(f):
        raise InvalidRequest(name, f"must be finite, got {f}")
    return f


def _text(name: str, value: Any) -> str:
    if not isinstance(value, bytes | np.bytes_ | str):
        raise InvalidRequest(name, f"expected BYTES (a UTF-8 string), got {type(value).__name__}")
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(name, f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def parse_request(
    inputs: Mapping[str, np.ndarray],
    parameters: Mapping[str, Any],
    tokenize: Tokenize,
    limits: EngineLimits,
    eos_ids: tuple[int, ...],
    vocab_size: int | None = None,
    faults_allowed: bool = False,
) -> GenerationRequest:
    """Validate ensemble inputs and tokenize the prompt and word lists. `faults_allowed`: the
    server lets clients inject faults (FAULT_PARAMETERS; config.FAULT_INJECTION_ENV)."""
    _check_names(inputs, parameters)
    if not faults_allowed and (fault := next((f for f in FAULT_PARAMETERS if f in parameters),
                                             None)):
        raise InvalidRequest(fault, f"fault injection is off on this server (a server started "
                                    f"with {FAULT_INJECTION_ENV}=1 allows it)")
    prompt_ids = _prompt_ids(inputs, tokenize, limits, vocab_size)
    v = {name: _scalar(name, kind, inputs[name])
         for name, kind in SCALAR_INPUTS.items() if name in inputs}
    max_tokens = _max_tokens(v, len(prompt_ids), limits)
    params = _sampling_params(v, max_tokens, eos_ids)
    if len(prompt_ids) + max_tokens > limits.max_seq_len or max_tokens <= 0:
        raise InvalidRequest(
            "input_ids" if "input_ids" in inputs else "text_input",
            f"prompt of {len(prompt_ids)} tokens plus max_tokens {max_tokens} exceeds the "
            f"context length ({limits.max_seq_len} tokens)",
        )
    guide_type, guide = _guide(inputs)
    params = dataclasses.replace(
        params,
        stop_sequences=_word_list(inputs, "stop_words", tokenize),
        bad_sequences=_word_list(inputs, "bad_words", tokenize),
        end_ids=_end_ids(params.end_ids, inputs, vocab_size),
        logit_bias=_logit_bias(inputs, vocab_size),
        guide_type=guide_type,
        guide=guide,
    )
    resume_ids = _resume_ids(inputs, max_tokens, vocab_size)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        params=params,
        stream=v.get("stream", False),
        exclude_input_in_output=v.get("exclude_input_in_output", False),
        tenant=_tenant(parameters),
        priority=_priority(v, parameters),
        stream_interval=_stream_interval(v),
        cache_salt=_cache_salt(inputs, parameters),
        resume_ids=resume_ids,
        **{name: _choice(name, parameters, choices) for name, choices in
           ROUTING_PARAMETERS.items() if name in parameters},
    )


def _check_names(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any]) -> None:
    unknown = sorted(set(inputs) - KNOWN_INPUTS)
    if unknown:
        raise InvalidRequest(unknown[0], f"unknown input; known inputs: {sorted(KNOWN_INPUTS)}")
    for name in sorted(parameters):
        if name in TENANT_PARAMETERS or name in ("priority", "cache_salt") or (
                name in ROUTING_PARAMETERS):
            continue
        if name not in TRITON_PARAMETERS and not name.startswith(TRITON_PARAMETER_PREFIX):
            raise InvalidRequest(
                name, f"unknown input or parameter; known inputs: {sorted(KNOWN_INPUTS)}"
            )


def _prompt_ids(inputs: Mapping[str, np.ndarray], tokenize: Tokenize, limits: EngineLimits,
                vocab_size: int | None) -> list[int]:
    """The prompt's token ids: `text_input` tokenized, or `input_ids` as they are."""
    if "input_ids" not in inputs:
        ids = tokenize(_prompt_text(inputs, limits), True)
        if not ids:
            raise InvalidRequest("text_input", "tokenizes to no tokens")
        return ids
    if "text_input" in inputs:
        raise InvalidRequest("input_ids", "a prompt is text_input or input_ids, not both")
    ids = _token_ids("input_ids", inputs["input_ids"], vocab_size)
    if not ids:
        raise InvalidRequest("input_ids", "must not be empty")
    return ids


def _token_ids(name: str, arr: np.ndarray, vocab_size: int | None) -> list[int]:
    if arr.dtype.kind not in "iu":
        raise InvalidRequest(name, f"expected an integer type, got {arr.dtype}")
    ids = [int(t) for t in arr.reshape(-1)]
    _in_vocabulary(name, ids, vocab_size)
    return ids


def _in_vocabulary(name: str, ids: list[int], vocab_size: int | None) -> None:
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        raise InvalidRequest(name, f"token id {bad} is outside the vocabulary (0-"
                             f"{(vocab_size or 0) - 1})")


def _end_ids(end_ids: tuple[int, ...], inputs: Mapping[str, np.ndarray],
             vocab_size: int | None) -> tuple[int, ...]:
    """The end ids with `stop_token_ids` added (these end the output even past `end_id` -1,
    as vLLM's stop_token_ids do with ignore_eos)."""
    if "stop_token_ids" not in inputs:
        return end_ids
    more = _token_ids("stop_token_ids", inputs["stop_token_ids"], vocab_size)
    return tuple(dict.fromkeys((*end_ids, *more)))


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 (ban) .. 100 (force)


def _logit_bias(inputs: Mapping[str, np.ndarray],
                vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """The `logit_bias` input: a JSON object {"<token id>": bias in [-100, 100]}."""
    text = _one_text(inputs, "logit_bias")
    if text is None:
        return ()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest("logit_bias", f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("logit_bias", "expected a JSON object of token id -> bias")
    out = []
    for key, bias in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest("logit_bias", f"key {key!r} is not a token id") from None
        _in_vocabulary("logit_bias", [token], vocab_size)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not (
                -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidRequest("logit_bias", f"the bias of token {token} must be a number "
                                 f"in [-100, 100], got {bias!r}")
        out.append((token, float(bias)))
    return tuple(sorted(out))


def _prompt_text(inputs: Mapping[str, np.ndarray], limits: EngineLimits) -> str:
    if "text_input" not in inputs:
        raise InvalidRequest("text_input", "is required (or input_ids)")
    text_arr = inputs["text_input"]
    if text_arr.dtype != np.object_ and text_arr.dtype.kind not in "SU":
        raise InvalidRequest("text_input", f"expected BYTES, got {text_arr.dtype}")
    if text_arr.size != 1:
        raise InvalidRequest("text_input", f"expected one prompt per request, got {text_arr.size}")
    text = _text("text_input", text_arr.reshape(-1)[0])
    if not text:
        raise InvalidRequest("text_input", "must not be empty")
    if len(text) > limits.max_seq_len * MAX_CHARS_PER_TOKEN:
        # Refuse before tokenizing: a huge prompt must not stall the tokenizer for everyone.
        raise InvalidRequest(
            "text_input", f"{len(text)} characters cannot fit the context of "
            f"{limits.max_seq_len} tokens"
        )
    return text


def _max_tokens(v: Mapping[str, Any], prompt_tokens: int, limits: EngineLimits) -> int:
    """The `max_tokens` input; unset: the default, shortened to the room the prompt leaves."""
    max_tokens = int(v.get("max_tokens", min(DEFAULT_MAX_TOKENS,
                                             limits.max_seq_len - prompt_tokens)))
    if "max_tokens" in v and max_tokens <= 0:
        raise InvalidRequest("max_tokens", f"must be at least 1, got {max_tokens}")
    if max_tokens >= limits.max_seq_len:
        raise InvalidRequest(
            "max_tokens", f"{max_tokens} exceeds the engine limit ({limits.max_seq_len - 1})"
        )
    return max_tokens


def _sampling_params(v: Mapping[str, Any], max_tokens: int,
                     eos_ids: tuple[int, ...]) -> SamplingParams:
    """The scalar sampling inputs, range-checked (word lists are added by the caller)."""
    temperature = v.get("temperature", 0.0)
    if temperature < 0:
        raise InvalidRequest("temperature", f"must be >= 0, got {temperature}")
    top_p = v.get("top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {top_p}")
    min_p = v.get("min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise InvalidRequest("min_p", f"must be in [0, 1], got {min_p}")
    top_k = v.get("top_k", 0)
    if top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0, got {top_k}")
    seed = v.get("seed")
    if seed is not None and seed < 0:
        raise InvalidRequest("seed", f"must be >= 0, got {seed}")
    repetition_penalty = v.get("repetition_penalty", 1.0)
    if repetition_penalty <= 0:
        raise InvalidRequest("repetition_penalty", f"must be > 0, got {repetition_penalty}")
    if "min_tokens" in v and "min_length" in v and v["min_tokens"] != v["min_length"]:
        raise InvalidRequest("min_length", "is an alias of min_tokens; they disagree")
    min_tokens = v.get("min_tokens", v.get("min_length", 0))
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequest("min_tokens", f"must be in [0, max_tokens], got {min_tokens}")
    top_log_probs = v.get("top_log_probs", 0)
    if not 0 <= top_log_probs <= MAX_TOP_LOG_PROBS:
        raise InvalidRequest("top_log_probs", f"must be in [0, {MAX_TOP_LOG_PROBS}], got "
                             f"{top_log_probs}")
    end_id = v.get("end_id")
    if end_id is not None and end_id < -1:
        raise InvalidRequest("end_id", f"must be a token id, or -1 for none; got {end_id}")
    # end_id -1: never stop on an end token (benchmarks' "ignore eos").
    end_ids = eos_ids if end_id is None else (() if end_id == -1 else (end_id,))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        presence_penalty=v.get("presence_penalty", 0.0),
        frequency_penalty=v.get("frequency_penalty", 0.0),
        min_tokens=min_tokens,
        end_ids=end_ids,
        # alternatives come with the sampled token's own log-probability
        return_log_probs=v.get("return_log_probs", False) or top_log_probs > 0,
        top_log_probs=top_log_probs,
    )


def _choice(name: str, parameters: Mapping[str, Any], choices: tuple[str, ...]) -> str:
    value = parameters[name]
    if value not in choices:
        raise InvalidRequest(name, f"must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


def _priority(values: Mapping[str, Any], parameters: Mapping[str, Any]) -> int:
    """From the `priority` input, else the `priority` request parameter; 0 .. MAX_PRIORITY."""
    value = values.get("priority", parameters.get("priority", 0))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise InvalidRequest("priority", f"must be an integer 0-{MAX_PRIORITY}, got {value!r}")
    return value


def _stream_interval(values: Mapping[str, Any]) -> int:
    """Tokens a streamed response holds at least (vLLM's per-request stream_interval)."""
    interval = values.get("stream_interval", 1)
    if interval < 1:
        raise InvalidRequest("stream_interval", f"must be at least 1, got {interval}")
    return interval


def _resume_ids(inputs: Mapping[str, np.ndarray], max_tokens: int,
                vocab_size: int | None) -> list[int]:
    """The `resume_ids` input: tokens generated before, by a server that failed; fewer than
    `max_tokens`, which counts them."""
    if "resume_ids" not in inputs:
        return []
    ids = _token_ids("resume_ids", inputs["resume_ids"], vocab_size)
    if len(ids) >= max_tokens:
        raise InvalidRequest("resume_ids", f"{len(ids)} tokens leave nothing to generate "
                             f"within max_tokens {max_tokens}")
    return ids


def _one_text(inputs: Mapping[str, np.ndarray], name: str) -> str | None:
    if name not in inputs:
        return None
    arr = inputs[name]
    if arr.size != 1:
        raise InvalidRequest(name, f"expected one value, got {arr.size}")
    return _text(name, arr.reshape(-1)[0])


def _guide(inputs: Mapping[str, np.ndarray]) -> tuple[str, str]:
    """(guide type, guide) of the structured-output inputs ("" and "": none), compiled once
    here (guides.grammar, cached) so that a schema or grammar that cannot be one is refused
    before any engine work."""
    guide_type = _one_text(inputs, "guided_decoding_guide_type")
    guide = _one_text(inputs, "guided_decoding_guide")
    if guide_type is None:
        if guide is not None:
            raise InvalidRequest("guided_decoding_guide_type",
                                 f"needed with guided_decoding_guide: one of {GUIDE_TYPES}")
        return "", ""
    if guide_type not in GUIDE_TYPES:
        raise InvalidRequest("guided_decoding_guide_type",
                             f"must be one of {', '.join(GUIDE_TYPES)}; got {guide_type!r}")
    if guide is None and guide_type != "json":
        raise InvalidRequest("guided_decoding_guide", f"needed for guide type {guide_type}")
    try:
        guides.grammar(guide_type, guide or "")
    except guides.InvalidGuide as e:
        raise InvalidRequest("guided_decoding_guide", f"not a valid {guide_type}: {e}") from None
    return guide_type, guide or ""


def _cache_salt(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any]) -> str:
    """The `cache_salt` input, else request parameter (a top-level `/generate` key); "" if
    neither: the front salts by tenant then."""
    if "cache_salt" in inputs:
        arr = inputs["cache_salt"]
        if arr.size != 1:
            raise InvalidRequest("cache_salt", f"expected one value, got {arr.size}")
        value: Any = _text("cache_salt", arr.reshape(-1)[0])
    else:
        value = parameters.get("cache_salt", "")
        if "cache_salt" in parameters and not isinstance(value, str):
            raise InvalidRequest("cache_salt",
                                 f"expected a string, got {type(value).__name__}")
    given = "cache_salt" in inputs or "cache_salt" in parameters
    if given and (not value or len(value) > MAX_CACHE_SALT_LEN or not value.isprintable()):
        raise InvalidRequest(
            "cache_salt", f"must be a printable string of 1-{MAX_CACHE_SALT_LEN} characters")
    return str(value)


def _tenant(parameters: Mapping[str, Any]) -> str:
    for name in TENANT_PARAMETERS:
        if name in parameters:
            value = parameters[name]
            if (not isinstance(value, str) or not value or len(value) > MAX_TENANT_LEN
                    or not value.isprintable()):
                raise InvalidRequest(
                    name, f"must be a printable string of 1-{MAX_TENANT_LEN} characters"
                )
            return value
    return DEFAULT_TENANT


def _word_list(
    inputs: Mapping[str, np.ndarray], name: str, tokenize: Tokenize
) -> tuple[tuple[int, ...], ...]:
    if name not in inputs:
        return ()
    words = [_text(name, w) for w in inputs[name].reshape(-1)]
    # Words match as token sequences. Mid-text, BPE tokenizers fold the preceding space into
    # the word's first token, so each word is also tried with a leading space.
    sequences: set[tuple[int, ...]] = set()
    for word in filter(None, words):
        for variant in (word,) if word.startswith(" ") else (word, " " + word):
            if ids := tokenize(variant, False):
                sequences.add(tuple(ids))
    return tuple(sorted(sequences))
