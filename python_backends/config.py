"""Engine configuration: what `scripts/build_engine.py` writes to `config.json`, validated once.

The engine directory is the unit an operator deploys: `config.json` (this file's dataclasses),
the tokenizer files and one safetensors file per rank. Loading it never dequantizes or reshards.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ENGINE_DIR = PROJECT_ROOT / "engines" / "smollm2"  # what scripts/serve.sh builds
ENGINE_DIR_ENV = "LLM_ENGINE_DIR"


def engine_dir_default() -> Path:
    """The engine a model or the gateway uses when told none: $LLM_ENGINE_DIR (what serve.sh
    and the container image set), else the default engine serve.sh builds."""
    return Path(os.environ.get(ENGINE_DIR_ENV) or DEFAULT_ENGINE_DIR)


def served_model_name(engine_dir: Path) -> str:
    """What clients call the model an engine directory serves: its config's `model_name`, else
    the directory's name (an engine not built yet, or built before engines had names)."""
    try:
        name = json.loads((engine_dir / CONFIG_FILE).read_text()).get("model_name", "")
    except (OSError, ValueError):
        name = ""
    return str(name) or engine_dir.name


API_KEY_ENV = "LLM_API_KEY"
# A server's role: which models it loads (launcher.ROLE_MODELS). The front model of a `front`
# server reaches engine groups on other servers only; an `aggregated` server is a whole server
# with the worker group alone (one engine instead of three: no prefill and decode).
ROLE_ENV = "LLM_ROLE"
# "1": clients may inject faults (the `kv_fault` and `engine_fault` request parameters, for drills
# and tests); anything else refuses them by name. Off unless the server is started with it.
FAULT_INJECTION_ENV = "LLM_FAULT_INJECTION"
ROLES = ("all", "front", "prefill", "decode", "worker", "aggregated")
ENGINE_GROUPS = ("worker", "prefill", "decode")
# The engine groups a role's server runs beside its front; other groups of its front, if any,
# are on other servers (front.remote).
FRONT_LOCAL_GROUPS = {"all": ENGINE_GROUPS, "front": (), "aggregated": ("worker",)}
API_KEY_HEADER = "x-api-key"
GRPC_API_KEY_HEADER = f"triton-grpc-protocol-{API_KEY_HEADER}"  # Triton's gRPC metadata name
# The module an engine's ranks 1..N-1 run (`python -m`): how their processes are told apart.
RANK_MODULE = "python_backends.engine.ranks"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # by torch dtype name
SUPPORTED_DTYPES = tuple(DTYPE_BYTES)
# How projections keep their weights: "" as the engine's dtype; "int8": quantized to int8 at load
# (one scale per output feature, activations quantized per call), CPU only, float32 engines.
SUPPORTED_WEIGHTS = ("", "int8")


class EngineConfigError(ValueError):
    """An engine directory or layout that cannot be served."""


ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as the checkpoint declares it (`rope_type`: ROPE_TYPES). LongRoPE (Phi-3,
    Phi-4-mini) divides each frequency by its short factor below the pretraining length
    (`original_max_position_embeddings`) and by its long factor beyond, and scales cos and sin
    by `attention_factor`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # LongRoPE's and YaRN's scale of cos and sin
    # YaRN (DeepSeek): frequencies between beta_fast and beta_slow rotations over the
    # pretraining length blend from extrapolated to interpolated (`truncate`: at whole dims).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise EngineConfigError(f"unsupported rope scaling type {self.rope_type!r} "
                                    f"(supported: {', '.join(ROPE_TYPES)})")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise EngineConfigError("longrope scaling needs its short_factor and long_factor")

    @property
    def attention_scale(self) -> float:
        return self.attention_factor if self.rope_type in ("longrope", "yarn") else 1.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeScaling:
        d = dict(d)
        for name in ("short_factor", "long_factor"):
            d[name] = tuple(float(f) for f in d.get(name, ()))
        return cls(**d)


@dataclass(frozen=True)
class ModelConfig:
    """What the shared decoder (models/decoder.py) computes: its shape and the switches in which
    families differ. Each family's file (models/registry.py) fills it from a checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Mixture of experts (Mixtral-style): experts per MoE layer (0: dense MLPs), and how many
    # each token is routed to. `intermediate_size` is then one expert's.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    # Whether the chosen experts' router weights are renormalized to sum to 1 (Mixtral: yes;
    # Qwen3-MoE: as its config's norm_topk_prob says).
    norm_topk_prob: bool = True
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before the rotation (Qwen3)
    rotary_dim: int = 0  # dimensions of a head the rotation turns (0: all; Phi-4-mini: 3/4)
    # Keys a query attends to, itself included (Mistral, Gemma); 0: the whole context.
    sliding_window: int = 0
    # Layers that see the whole context all the same (Gemma's full-attention layers).
    global_layers: tuple[int, ...] = ()
    local_rope_theta: float = 0.0  # Gemma 3: the rotation base of windowed layers (0: the same)
    attention_scale: float = 0.0  # query scaling (0: head_dim ** -0.5)
    attn_logit_softcap: float = 0.0  # Gemma 2: attention scores s -> cap * tanh(s / cap)
    final_logit_softcap: float = 0.0  # Gemma 2: the logits likewise
    embedding_multiplier: float = 1.0  # Gemma: embeddings scaled by sqrt(hidden_size)
    hidden_act: str = "silu"  # the MLP gate's: HIDDEN_ACTS (SwiGLU, or Gemma's GeGLU)
    # Gemma 2/3: a norm after attention and after the MLP too (pre_feedforward_layernorm,
    # post_feedforward_layernorm; post_attention_layernorm then normalizes attention's output).
    sandwich_norms: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3; models.latent_attention), where kv_lora_rank
    # is not 0: the cache holds per token the compressed KV (kv_lora_rank) and the rotated key
    # part all heads share (rotary_dim); queries and keys have head_dim = the unrotated part +
    # rotary_dim, values v_head_dim; queries pass a low-rank projection where q_lora_rank is not 0.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotated dimensions paired as (0, 1), (2, 3)... (DeepSeek)
    # DeepSeek's experts: router scores by sigmoid (router_scoring) plus a selection bias,
    # chosen within the best topk_group of n_group expert groups, weights scaled by
    # routed_scaling_factor; shared experts (one MLP n_shared_experts experts wide) for every
    # token; the first first_dense_layers layers dense (intermediate_size wide), experts
    # moe_intermediate_size wide (0: intermediate_size).
    router_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_dense_layers: int = 0
    moe_intermediate_size: int = 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.num_experts) and index >= self.first_dense_layers

    def is_windowed_layer(self, index: int) -> bool:
        """Whether layer `index` (of the whole model) attends within the sliding window."""
        return bool(self.sliding_window) and index not in self.global_layers

    @property
    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(planes, KV heads, head size) of the whole model's cache per token and layer: K and V
        per KV head, or one latent vector (kv_lora_rank + rotary_dim) under latent attention."""
        if self.kv_lora_rank:
            return 1, 1, self.kv_lora_rank + self.rotary_dim
        return 2, self.num_kv_heads, self.head_dim

    @property
    def window_everywhere(self) -> int:
        """The window where every layer has it (what lets a sequence release blocks behind
        it), else 0."""
        return 0 if self.global_layers else self.sliding_window

    def __post_init__(self) -> None:
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise EngineConfigError(f"router_scoring {self.router_scoring!r}: softmax or sigmoid")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise EngineConfigError(f"{self.num_experts} experts in n_group={self.n_group} "
                                    f"groups, topk_group={self.topk_group}: the groups must "
                                    "divide the experts and topk_group be in 1..n_group")
        if self.kv_lora_rank and not self.rotary_dim:
            raise EngineConfigError("latent attention needs its rotated part (rotary_dim)")
        if self.hidden_act not in HIDDEN_ACTS:
            raise EngineConfigError(f"activation {self.hidden_act!r} is not supported "
                                    f"(supported: {', '.join(HIDDEN_ACTS)})")
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise EngineConfigError(f"rotary_dim ({self.rotary_dim}) must be even and at most "
                                    f"the head size ({self.head_dim})")
        if self.sliding_window < 0:
            raise EngineConfigError("sliding_window must be >= 0")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise EngineConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1.."
                f"{self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise EngineConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["rope_scaling"] = RopeScaling.from_dict(d.get("rope_scaling", {}))
        d["global_layers"] = tuple(d.get("global_layers", ()))
        return cls(**d)


@dataclass(frozen=True)
class EngineLimits:
    """Serving limits baked into the engine; requests beyond them are refused at the edge."""

    max_seq_len: int = 2048  # prompt + generated tokens of one sequence
    max_num_seqs: int = 64  # sequences in one running batch
    max_num_batched_tokens: int = 2048  # tokens computed in one step (chunked-prefill budget)
    block_size: int = 16  # tokens per KV-cache block

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be positive")


@dataclass(frozen=True)
class ParallelLayout:
    """Ranks of one engine instance; one weight file per rank.

    A pipeline stage has `stage_size` = max(tp, ep) ranks: attention (and dense MLPs) split over
    tp of them, a mixture-of-experts layer's experts over ep. Rank r is local rank `r %
    stage_size` of stage `r // stage_size`. Rank 0 runs in the serving process and drives the
    others (python_backends/parallel).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def stage_size(self) -> int:
        return max(self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ep > 1 and self.tp not in (1, self.ep):
            raise EngineConfigError(
                f"tp={self.tp} with ep={self.ep}: experts and attention share a stage's ranks, "
                "so tp must be 1 (attention replicated) or equal ep")

    def check(self, model: ModelConfig) -> None:
        """Refuse a layout the model cannot take, saying why."""
        if model.kv_lora_rank and self.tp > 1:
            raise EngineConfigError(
                f"tp={self.tp}: latent attention caches one vector per token that every head "
                "reads, so its heads are not split across ranks here; split the experts (ep) "
                "or the layers (pp)")
        if model.num_kv_heads % self.tp:
            possible = [t for t in range(1, model.num_kv_heads + 1) if model.num_kv_heads % t == 0]
            raise EngineConfigError(
                f"tp={self.tp} does not divide the model's {model.num_kv_heads} KV heads "
                f"(KV heads are split across tensor-parallel ranks); possible tp: {possible}"
            )
        if (not model.num_experts or model.first_dense_layers) and (
                model.intermediate_size % self.tp):
            raise EngineConfigError(f"tp={self.tp} does not divide the MLP's intermediate size "
                                    f"{model.intermediate_size}")
        if self.pp > model.num_layers:
            raise EngineConfigError(f"pp={self.pp} exceeds the model's {model.num_layers} layers")
        if self.ep > 1 and not model.num_experts:
            raise EngineConfigError(f"ep={self.ep} needs a mixture-of-experts model; this one "
                                    "has dense MLPs")
        if model.num_experts % self.ep:
            raise EngineConfigError(f"ep={self.ep} does not divide the model's "
                                    f"{model.num_experts} experts")

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """Contiguous layers of pipeline stage `stage` (earlier stages take the remainder)."""
        base, extra = divmod(num_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))


@dataclass(frozen=True)
class TokenizerInfo:
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    has_chat_template: bool


@dataclass(frozen=True)
class EngineConfig:
    architecture: str  # the checkpoint's model_type: a family of models.registry
    dtype: str
    model: ModelConfig
    limits: EngineLimits
    tokenizer: TokenizerInfo
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    source: str = ""
    format_version: int = FORMAT_VERSION
    # The name clients ask for (the gateway's /v1/models): --served-model-name at build, else
    # the engine directory's name (engines/smollm2: "smollm2").
    model_name: str = ""
    weights: str = ""  # SUPPORTED_WEIGHTS

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise EngineConfigError(f"unsupported dtype {self.dtype!r}")
        if self.weights not in SUPPORTED_WEIGHTS:
            raise EngineConfigError(f"unsupported weights {self.weights!r}")
        if self.weights == "int8" and self.dtype != "float32":
            raise EngineConfigError("int8 weights need a float32 engine (its activations and "
                                    f"KV cache), not {self.dtype}")
        self.parallel.check(self.model)
        if self.limits.max_seq_len > self.model.max_position_embeddings:
            raise EngineConfigError(
                f"max_seq_len {self.limits.max_seq_len} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}"
            )

    def weight_files(self) -> list[str]:
        return [f"rank{r}.safetensors" for r in range(self.parallel.world_size)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, engine_dir: Path) -> None:
        (engine_dir / CONFIG_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, engine_dir: str | Path) -> EngineConfig:
        path = Path(engine_dir) / CONFIG_FILE
        if not path.is_file():
            raise EngineConfigError(
                f"{path} not found: build an engine with scripts/build_engine.py first"
            )
        d = json.loads(path.read_text())
        if d.get("format_version") != FORMAT_VERSION:
            raise EngineConfigError(
                f"{path}: format_version {d.get('format_version')} != {FORMAT_VERSION}; rebuild"
            )
        tok = dict(d["tokenizer"])
        tok["eos_token_ids"] = tuple(tok["eos_token_ids"])
        return cls(
            architecture=d["architecture"],
            dtype=d["dtype"],
            model=ModelConfig.from_dict(d["model"]),
            limits=EngineLimits(**d["limits"]),
            tokenizer=TokenizerInfo(**tok),
            parallel=ParallelLayout(**d.get("parallel", {})),
            source=d.get("source", ""),
            weights=d.get("weights", ""),
            model_name=d.get("model_name", ""),
        )
