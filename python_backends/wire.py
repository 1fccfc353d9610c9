"""Every message that crosses a model boundary, and its one encoding as Triton tensors.

A message is a frozen dataclass whose fields are tensors (`_tensor(NAME, KIND)`). `encode`
turns it into name -> numpy array, `decode` reads it back from the arrays a model received; the
Triton glue (serving.common) only wraps and unwraps those arrays. This module is the only place
the repository's tensor names are written: tests/test_wire.py checks every config.pbtxt
against `MODEL_INTERFACES`.

The path of one request (docs/architecture.md draws it):
  ensemble inputs -> preprocessing -> TokenizedRequest -> front -> EngineRequest -> worker or
  decode -> TokenStep -> front; or EngineRequest -> prefill -> PrefillReply -> front;
  front -> ClientChunk -> postprocessing -> ClientOutput (the ensemble's outputs).

Free of torch and of Triton: the front's stub imports it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np

from python_backends.params import SamplingParams

DEFAULT_TENANT = "default"
FINISH_ERROR = "error"  # the finish_reason of a stream that failed after its first chunk
# The front's start time on a server's metrics port: when it changes, the requests the previous
# front held are lost (the gateway watches it).
FRONT_START_METRIC = "llm_front_start_time_seconds"


class Kind(enum.Enum):
    """How a field is carried: its Triton data type and whether it is a list (dims [-1]) or
    one value (dims [1])."""

    INT = enum.auto()
    UINT64 = enum.auto()
    FLOAT = enum.auto()
    BOOL = enum.auto()
    TEXT = enum.auto()  # str, UTF-8
    BLOB = enum.auto()  # bytes as they are
    JSON = enum.auto()  # a record with to_json / from_json
    INTS = enum.auto()
    FLOATS = enum.auto()
    TEXTS = enum.auto()
    PACKED = enum.auto()  # a whole message in one tensor (Message.PACKED)

    @property
    def triton_type(self) -> str:
        return _TRITON_TYPES[self]

    @property
    def numpy_type(self) -> Any:
        return _NUMPY_TYPES.get(self, np.object_)

    @property
    def is_list(self) -> bool:
        return self in (Kind.INTS, Kind.FLOATS, Kind.TEXTS, Kind.PACKED)


_TRITON_TYPES = {Kind.INT: "TYPE_INT32", Kind.UINT64: "TYPE_UINT64", Kind.FLOAT: "TYPE_FP32",
                 Kind.BOOL: "TYPE_BOOL", Kind.INTS: "TYPE_INT32", Kind.FLOATS: "TYPE_FP32",
                 Kind.TEXT: "TYPE_STRING", Kind.BLOB: "TYPE_STRING", Kind.JSON: "TYPE_STRING",
                 Kind.TEXTS: "TYPE_STRING", Kind.PACKED: "TYPE_UINT8"}
_NUMPY_TYPES = {Kind.INT: np.int32, Kind.UINT64: np.uint64, Kind.FLOAT: np.float32,
                Kind.BOOL: np.bool_, Kind.INTS: np.int32, Kind.FLOATS: np.float32,
                Kind.PACKED: np.uint8}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    kind: Kind
    optional: bool = False
    variable: bool = False  # declared with dims [-1] even when it carries one value

    @property
    def dims(self) -> list[int]:
        return [-1] if self.kind.is_list or self.variable else [1]


def _tensor(name: str, kind: Kind, default: Any = dataclasses.MISSING,
            variable: bool = False) -> Any:
    """A dataclass field carried as tensor `name`; a field with a default is optional (a list
    default is the empty list)."""
    spec = TensorSpec(name, kind, default is not dataclasses.MISSING, variable)
    if isinstance(default, list):
        return field(default_factory=list, metadata={"tensor": spec})
    return field(default=default, metadata={"tensor": spec})


class Message:
    """Base of the typed messages: encoding and decoding from the fields' tensor specs.

    A message whose class sets `PACKED` travels as that one UINT8 tensor holding every field
    (`pack`), not a tensor per field. Engines answer once per step, and in Triton 2.51 a
    decoupled BLS caller's stub keeps every response of a call, each tensor as a C++ object, a
    numpy array and a block of its shared memory, until the call ends: a tensor per field made
    a token cost the front about 9 KiB for the length of its stream (docs/platform.md)."""

    JSON_TYPES: ClassVar[dict[str, type]] = {}
    PACKED: ClassVar[str] = ""

    @classmethod
    def specs(cls) -> list[TensorSpec]:
        if cls.PACKED:
            return [TensorSpec(cls.PACKED, Kind.PACKED)]
        return cls.field_specs()

    @classmethod
    def field_specs(cls) -> list[TensorSpec]:
        return [f.metadata["tensor"] for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def names(cls) -> list[str]:
        return [s.name for s in cls.specs()]

    def encode(self, batched: bool) -> dict[str, np.ndarray]:
        """Name -> array; `batched`: with the leading batch dimension of 1 that models with a
        max_batch_size expect. Optional fields that are None are left out."""
        if self.PACKED:
            packed = np.frombuffer(self.pack(), dtype=np.uint8)
            return {self.PACKED: packed[None, ...] if batched else packed}
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue
            spec: TensorSpec = f.metadata["tensor"]
            arr = _to_array(spec.kind, value)
            out[spec.name] = arr[None, ...] if batched else arr
        return out

    @classmethod
    def decode(cls, arrays: Mapping[str, np.ndarray]) -> Self:
        """From the arrays a model received (any batch shape); a missing optional tensor reads
        as its default. A missing required one is a KeyError naming it."""
        if cls.PACKED:
            if cls.PACKED not in arrays:
                raise KeyError(f"{cls.__name__}: tensor {cls.PACKED} missing")
            return cls.unpack(arrays[cls.PACKED].tobytes())
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec: TensorSpec = f.metadata["tensor"]
            if spec.name in arrays:
                values[f.name] = _from_array(spec.kind, arrays[spec.name],
                                             cls.JSON_TYPES.get(f.name))
            elif not spec.optional:
                raise KeyError(f"{cls.__name__}: tensor {spec.name} missing")
        return cls(**values)

    def pack(self) -> bytes:
        """Every field in declaration order, little-endian: INT int32, UINT64 uint64, FLOAT
        float32, BOOL one byte; TEXT and BLOB a uint32 length and the bytes (UTF-8); INTS and
        FLOATS a uint32 count and the values; TEXTS a count and each text as TEXT."""
        parts: list[bytes] = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                raise ValueError(f"{type(self).__name__}.{f.name}: a packed message carries "
                                 "every field")
            _pack(f.metadata["tensor"].kind, value, parts)
        return b"".join(parts)

    @classmethod
    def unpack(cls, data: bytes) -> Self:
        """The message `pack` wrote; ValueError when `data` is not one."""
        view = memoryview(data)
        values, at = {}, 0
        try:
            for f in dataclasses.fields(cls):  # type: ignore[arg-type]
                values[f.name], at = _unpack(f.metadata["tensor"].kind, view, at,
                                             cls.JSON_TYPES.get(f.name))
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{cls.__name__}: not a packed message: {e}") from None
        if at != len(view):
            raise ValueError(f"{cls.__name__}: {len(view) - at} bytes after the message")
        return cls(**values)


_SCALAR_FORMATS = {Kind.INT: struct.Struct("<i"), Kind.UINT64: struct.Struct("<Q"),
                   Kind.FLOAT: struct.Struct("<f"), Kind.BOOL: struct.Struct("<?")}
_ITEM_CODES = {Kind.INTS: "i", Kind.FLOATS: "f"}
_COUNT = struct.Struct("<I")


def _pack(kind: Kind, value: Any, parts: list[bytes]) -> None:
    if kind in _SCALAR_FORMATS:
        parts.append(_SCALAR_FORMATS[kind].pack(value))
    elif kind in _ITEM_CODES:
        parts.append(struct.pack(f"<I{len(value)}{_ITEM_CODES[kind]}", len(value), *value))
    elif kind is Kind.TEXTS:
        parts.append(_COUNT.pack(len(value)))
        for item in value:
            _pack(Kind.TEXT, item, parts)
    elif kind in (Kind.TEXT, Kind.BLOB, Kind.JSON):
        raw = value.to_json() if kind is Kind.JSON else value
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        parts += (_COUNT.pack(len(raw)), raw)
    else:
        raise ValueError(f"a {kind.name} field cannot be packed")


def _unpack(kind: Kind, view: memoryview, at: int, json_type: type | None) -> tuple[Any, int]:
    if kind in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[kind]
        (value,) = fmt.unpack_from(view, at)
        return value, at + fmt.size
    (count,) = _COUNT.unpack_from(view, at)
    at += _COUNT.size
    if kind in _ITEM_CODES:
        items = struct.unpack_from(f"<{count}{_ITEM_CODES[kind]}", view, at)
        return list(items), at + 4 * count
    if kind is Kind.TEXTS:
        texts = []
        for _ in range(count):
            text, at = _unpack(Kind.TEXT, view, at, None)
            texts.append(text)
        return texts, at
    if at + count > len(view):
        raise struct.error(f"a {count}-byte field past the end")
    raw = bytes(view[at:at + count])
    at += count
    if kind is Kind.BLOB:
        return raw, at
    if kind is Kind.JSON:
        assert json_type is not None
        return json_type.from_json(raw), at  # type: ignore[attr-defined]
    return raw.decode(), at


def _to_array(kind: Kind, value: Any) -> np.ndarray:
    if kind is Kind.JSON:
        value = value.to_json()
    if kind in (Kind.TEXT, Kind.BLOB, Kind.JSON, Kind.TEXTS):
        items = value if kind.is_list else [value]
        return np.array([v.encode() if isinstance(v, str) else bytes(v) for v in items],
                        dtype=np.object_)
    return np.array(value if kind.is_list else [value], dtype=kind.numpy_type)


def _from_array(kind: Kind, arr: np.ndarray, json_type: type | None) -> Any:
    flat = arr.reshape(-1)
    if kind.is_list:
        return [bytes(v).decode() for v in flat] if kind is Kind.TEXTS else flat.tolist()
    value = flat[0]
    if kind is Kind.TEXT:
        return bytes(value).decode()
    if kind is Kind.BLOB:
        return bytes(value)
    if kind is Kind.JSON:
        assert json_type is not None
        return json_type.from_json(bytes(value))  # type: ignore[attr-defined]
    if kind is Kind.BOOL:
        return bool(value)
    return float(value) if kind is Kind.FLOAT else int(value)


# --- what a request asks for -------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request (front.validation makes it): what every model after
    preprocessing works from. Carried as JSON in the REQUEST tensor."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    tenant: str = DEFAULT_TENANT
    priority: int = 0
    route: str = "auto"  # front.routing.Route's values, or "auto"
    kv_transport: str = ""  # "" = the prefill instance's default
    kv_fault: str = ""  # front.validation.KV_FAULTS
    engine_fault: str = ""  # front.validation.ENGINE_FAULTS
    # Tokens a streamed response holds at least, but the first and last (the engine's own
    # stream_interval raises it: serving.options.GeneratorOptions.interval).
    stream_interval: int = 1
    # Prefix-cache isolation: only requests with the same salt share cached KV. The client's
    # `cache_salt`, else (set by the front) its tenant's.
    cache_salt: str = ""
    # Tokens another server generated before it failed (the gateway moved the request): they
    # count toward max_tokens and are computed with the prompt; only new tokens are streamed.
    resume_ids: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        """Fields at their defaults are left out, so a request that asks for nothing newer than
        an engine server knows reads there too: the servers of a cluster may run different
        versions while it is upgraded (docs/cluster.md). A reader that does not know a field
        refuses the request rather than serve it without (from_json)."""
        params = {**_non_default(self.params),
                  **{k: getattr(self.params, k) for k in _ALWAYS_WRITTEN_PARAMS}}
        return json.dumps({**_non_default(self), "params": params})

    @classmethod
    def from_json(cls, text: str | bytes) -> GenerationRequest:
        d = json.loads(text)
        p = d.pop("params")
        p["end_ids"] = tuple(p.get("end_ids", ()))
        p["stop_sequences"] = tuple(tuple(s) for s in p.get("stop_sequences", ()))
        p["bad_sequences"] = tuple(tuple(s) for s in p.get("bad_sequences", ()))
        p["logit_bias"] = tuple((int(t), float(b)) for t, b in p.get("logit_bias", ()))
        return cls(params=SamplingParams(**p), **d)


# Readers before fields were left out at their defaults index these directly.
_ALWAYS_WRITTEN_PARAMS = ("max_tokens", "end_ids", "stop_sequences", "bad_sequences", "logit_bias")


def _non_default(obj: Any) -> dict[str, Any]:
    """A dataclass's fields (by name, as they are), less those at their default values."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
            continue
        out[f.name] = value
    return out


# --- the messages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizedRequest(Message):
    """preprocessing -> front."""

    JSON_TYPES: ClassVar[dict[str, type]] = {"request": GenerationRequest}
    request: GenerationRequest = _tensor("REQUEST", Kind.JSON)


@dataclass(frozen=True)
class EngineRequest(Message):
    """front -> worker, decode or prefill. `cancel_board` and `cancel_ticket` name the flag the
    front raises when the client goes away (flag_board); a direct caller leaves them out. A
    request prefilled elsewhere carries its KV handle (kv_transfer.KVHandle as JSON) and first
    token, for decode. A request migrated from an engine that died carries the tokens generated
    so far (`resume_ids`): the engine computes them with the prompt and goes on from there."""

    JSON_TYPES: ClassVar[dict[str, type]] = {"request": GenerationRequest}
    request: GenerationRequest = _tensor("REQUEST", Kind.JSON)
    cancel_board: str | None = _tensor("CANCEL_BOARD", Kind.TEXT, None)
    cancel_ticket: int = _tensor("CANCEL_TICKET", Kind.INT, 0)
    kv_handle: bytes | None = _tensor("KV_HANDLE", Kind.BLOB, None)
    first_token: int | None = _tensor("FIRST_TOKEN", Kind.INT, None)
    first_log_prob: float | None = _tensor("FIRST_LOG_PROB", Kind.FLOAT, None)
    resume_ids: list[int] | None = _tensor("RESUME_IDS", Kind.INTS, None)


class ErrorKind(enum.Enum):
    """Why an engine could not finish a request; the front answers the client accordingly."""

    INVALID = "invalid"  # the request can never be served here (too large): the client's
    UNAVAILABLE = "unavailable"  # the instance is going away: retry
    INTERNAL = "internal"  # the engine failed


@dataclass(frozen=True)
class TokenStep(Message):
    """worker or decode -> front: one sequence's new tokens from a step (one, or more where a
    speculative draft was kept) or from several (a stream_interval above 1); none in a final
    "cancelled" or "error" answer. An engine's error travels here, as data in a final step,
    never as a Triton error: a decoupled BLS call never receives an error response that is not
    its first (docs/platform.md). Packed in one tensor: there is one per step (see Message)."""

    PACKED: ClassVar[str] = "STEP"
    output_ids: list[int] = _tensor("OUTPUT_IDS", Kind.INTS)
    output_log_probs: list[float] = _tensor("OUTPUT_LOG_PROBS", Kind.FLOATS)
    finish_reason: str = _tensor("FINISH_REASON", Kind.TEXT)  # "" until the last step
    num_input_tokens: int = _tensor("NUM_INPUT_TOKENS", Kind.INT)
    num_output_tokens: int = _tensor("NUM_OUTPUT_TOKENS", Kind.INT)
    error: str = _tensor("ERROR", Kind.TEXT, "")  # the message, with finish reason "error"
    error_kind: str = _tensor("ERROR_KIND", Kind.TEXT, "")  # an ErrorKind value
    # With top_log_probs k: each token's k likeliest alternatives, token by token (k ids, then
    # the next token's k; their log-probabilities likewise).
    top_ids: list[int] = _tensor("TOP_IDS", Kind.INTS, [])
    top_log_probs: list[float] = _tensor("TOP_LOG_PROBS", Kind.FLOATS, [])


@dataclass(frozen=True)
class PrefillReply(Message):
    """prefill -> front: the first token and, when the sequence goes on, the KV handle (JSON of
    kv_transfer.KVHandle; empty when the first token already ended it)."""

    token_id: int = _tensor("OUTPUT_IDS", Kind.INT)
    log_prob: float = _tensor("OUTPUT_LOG_PROBS", Kind.FLOAT)
    finish_reason: str = _tensor("FINISH_REASON", Kind.TEXT)
    kv_handle: bytes = _tensor("KV_HANDLE", Kind.BLOB)
    top_ids: list[int] = _tensor("TOP_IDS", Kind.INTS)  # as TokenStep's
    top_log_probs: list[float] = _tensor("TOP_LOG_PROBS", Kind.FLOATS)


@dataclass(frozen=True)
class ClientChunk(Message):
    """front -> postprocessing (or the gateway, calling the front itself): what one client
    response needs. `tokens` is a window to detokenize whose first `prefix_len` ids were sent
    before (see detokenizer). Packed in one tensor: there is one per streamed step, and each
    tensor of it costs the front's stub, tritonserver's ensemble and postprocessing's stub an
    allocation and a copy (one tensor instead of 13 took the serving processes' CPU per
    streamed token down by about 15%; docs/benchmarks.md, "One tensor a chunk")."""

    PACKED: ClassVar[str] = "CHUNK"
    cancel_board: str = _tensor("CANCEL_BOARD", Kind.TEXT)
    cancel_ticket: int = _tensor("CANCEL_TICKET", Kind.INT)
    tokens: list[int] = _tensor("TOKENS", Kind.INTS)
    prefix_len: int = _tensor("PREFIX_LEN", Kind.INT)
    output_ids: list[int] = _tensor("OUTPUT_IDS", Kind.INTS)  # generated ids it reports
    finish_reason: str = _tensor("FINISH_REASON", Kind.TEXT)  # "" until the last chunk
    num_input_tokens: int = _tensor("NUM_INPUT_TOKENS", Kind.INT)
    num_output_tokens: int = _tensor("NUM_OUTPUT_TOKENS", Kind.INT)
    cum_log_prob: float = _tensor("CUM_LOG_PROBS", Kind.FLOAT)
    output_log_probs: list[float] = _tensor("OUTPUT_LOG_PROBS", Kind.FLOATS)
    # Why the request failed, with finish_reason "error": a failure after a stream's first
    # chunk ends the stream as data (a Triton error then would hit the 2.51 ensemble bug, see
    # docs/platform.md). "" otherwise.
    error: str = _tensor("ERROR", Kind.TEXT)
    top_ids: list[int] = _tensor("TOP_IDS", Kind.INTS)  # for output_ids, as TokenStep's
    top_log_probs: list[float] = _tensor("TOP_LOG_PROBS", Kind.FLOATS)

    @classmethod
    def probe(cls, cancel_board: str, cancel_ticket: int) -> ClientChunk:
        """A chunk that reports nothing: it only asks postprocessing whether the client is
        still there (front.liveness)."""
        return cls(cancel_board, cancel_ticket, [], 0, [], "", 0, 0, 0.0, [], "", [], [])

    def failed(self, message: str) -> ClientChunk:
        """The final chunk of a stream that failed after this chunk: no new tokens, this
        chunk's counts, finish_reason "error" and the message."""
        return dataclasses.replace(self, tokens=[], prefix_len=0, output_ids=[],
                                   output_log_probs=[], finish_reason=FINISH_ERROR,
                                   error=message, top_ids=[], top_log_probs=[])

    @property
    def is_probe(self) -> bool:
        return not self.tokens and not self.output_ids and not self.finish_reason

    def output(self, text: str) -> ClientOutput:
        """What the client gets for this chunk, `text` being its tokens' (detokenizer)."""
        return ClientOutput(
            text_output=text,
            finish_reason=self.finish_reason,
            num_input_tokens=self.num_input_tokens,
            num_output_tokens=self.num_output_tokens,
            cum_log_probs=self.cum_log_prob,
            output_log_probs=self.output_log_probs,
            output_ids=self.output_ids,
            error_message=self.error,
            output_top_ids=self.top_ids,
            output_top_log_probs=self.top_log_probs,
        )


@dataclass(frozen=True)
class ClientOutput(Message):
    """postprocessing (or the gateway, calling the front itself) -> the client: the ensemble's
    outputs (the Triton TensorRT-LLM backend's names; declared with dims [-1], as that
    backend's are)."""

    text_output: str = _tensor("text_output", Kind.TEXT, variable=True)
    finish_reason: str = _tensor("finish_reason", Kind.TEXT, variable=True)
    num_input_tokens: int = _tensor("num_input_tokens", Kind.INT, variable=True)
    num_output_tokens: int = _tensor("num_output_tokens", Kind.INT, variable=True)
    cum_log_probs: float = _tensor("cum_log_probs", Kind.FLOAT, variable=True)
    output_log_probs: list[float] = _tensor("output_log_probs", Kind.FLOATS, variable=True)
    output_ids: list[int] = _tensor("output_ids", Kind.INTS, variable=True)
    error_message: str = _tensor("error_message", Kind.TEXT, variable=True)  # "" unless failed
    # with top_log_probs k: each output token's k likeliest alternatives (k ids, then the next
    # token's k), and their log-probabilities
    output_top_ids: list[int] = _tensor("output_top_ids", Kind.INTS, variable=True)
    output_top_log_probs: list[float] = _tensor("output_top_log_probs", Kind.FLOATS,
                                                variable=True)


@dataclass(frozen=True)
class StoreQuery(Message):
    """anyone -> kv_store: ask what the node's KV store holds (the text is not read)."""

    query: str = _tensor("QUERY", Kind.TEXT)


@dataclass(frozen=True)
class StoreStatus(Message):
    """kv_store -> caller: its name, size, use and evictions, as JSON."""

    status: str = _tensor("STATUS", Kind.TEXT)


# The ensemble's inputs (the Triton TensorRT-LLM backend's names), all optional in the config;
# front.validation parses and checks them.
CLIENT_INPUTS: dict[str, TensorSpec] = {name: TensorSpec(name, kind, optional=True)
                                      for name, kind in (
    ("text_input", Kind.TEXT),
    ("input_ids", Kind.INTS),  # the prompt as token ids, instead of text_input
    ("max_tokens", Kind.INT),
    ("stream", Kind.BOOL),
    ("temperature", Kind.FLOAT),
    ("top_k", Kind.INT),
    ("top_p", Kind.FLOAT),
    ("min_p", Kind.FLOAT),
    ("seed", Kind.UINT64),
    ("stop_words", Kind.TEXTS),
    ("bad_words", Kind.TEXTS),
    ("end_id", Kind.INT),
    ("stop_token_ids", Kind.INTS),  # more ids that end the output, besides the end id
    ("pad_id", Kind.INT),
    ("min_tokens", Kind.INT),
    ("min_length", Kind.INT),  # genai-perf's name for min_tokens
    ("repetition_penalty", Kind.FLOAT),
    ("presence_penalty", Kind.FLOAT),
    ("frequency_penalty", Kind.FLOAT),
    ("logit_bias", Kind.TEXT),  # JSON {"<token id>": bias}, as OpenAI's logit_bias
    ("exclude_input_in_output", Kind.BOOL),
    ("return_log_probs", Kind.BOOL),
    ("top_log_probs", Kind.INT),  # with each token, the log-probabilities of its k likeliest
    ("priority", Kind.INT),
    ("stream_interval", Kind.INT),  # send a stream's tokens this many at a time (vLLM's)
    ("cache_salt", Kind.TEXT),
    ("resume_ids", Kind.INTS),  # a request moved from another server: its tokens so far
    ("guided_decoding_guide_type", Kind.TEXT),  # structured output: guides.GUIDE_TYPES
    ("guided_decoding_guide", Kind.TEXT),  # its JSON schema, regex, grammar or choice list
)}

# Model name -> (its inputs, its outputs). Prefill takes an EngineRequest without the handoff.
MODEL_INTERFACES: dict[str, tuple[list[TensorSpec], list[TensorSpec]]] = {
    "ensemble": (list(CLIENT_INPUTS.values()), ClientOutput.specs()),
    "preprocessing": (list(CLIENT_INPUTS.values()), TokenizedRequest.specs()),
    "front": (TokenizedRequest.specs(), ClientChunk.specs()),
    "worker": (EngineRequest.specs(), TokenStep.specs()),
    "decode": (EngineRequest.specs(), TokenStep.specs()),
    "prefill": ([s for s in EngineRequest.specs()
                 if s.name not in ("KV_HANDLE", "FIRST_TOKEN", "FIRST_LOG_PROB", "RESUME_IDS")],
                PrefillReply.specs()),
    "postprocessing": (ClientChunk.specs(), ClientOutput.specs()),
    "kv_store": (StoreQuery.specs(), StoreStatus.specs()),
}
