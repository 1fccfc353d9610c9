"""serving.options: each model's parameters, typed and checked once; every shipped
config.pbtxt lists exactly its model's options, at their defaults."""

from __future__ import annotations

import dataclasses
import re

import pytest

from python_backends.config import PROJECT_ROOT
from python_backends.serving.options import (
    DecodeOptions,
    FrontOptions,
    GeneratorOptions,
    KVStoreOptions,
    OptionError,
    PrefillOptions,
    TokenizerOptions,
    parse,
)

REPOSITORY = PROJECT_ROOT / "model_repository"
MODEL_OPTIONS: dict[str, type] = {
    "preprocessing": TokenizerOptions, "postprocessing": TokenizerOptions,
    "front": FrontOptions, "worker": GeneratorOptions, "decode": DecodeOptions,
    "prefill": PrefillOptions, "kv_store": KVStoreOptions,
}
PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*'
                       r'"([^"]*)"\s*\}\s*\}')


def config_parameters(model: str) -> dict[str, str]:
    return dict(PARAMETER.findall((REPOSITORY / model / "config.pbtxt").read_text()))


def test_every_python_model_has_its_options() -> None:
    python_models = {p.parent.name for p in REPOSITORY.glob("*/config.pbtxt")
                     if 'backend: "python"' in p.read_text()}
    assert python_models == set(MODEL_OPTIONS)


@pytest.mark.parametrize("model", sorted(MODEL_OPTIONS))
def test_a_config_lists_every_option_at_its_default(model: str) -> None:
    cls = MODEL_OPTIONS[model]
    params = config_parameters(model)
    assert set(params) == {f.name for f in dataclasses.fields(cls)}, model
    assert parse(cls, params) == cls()  # the defaults live in one place: the class


def test_empty_means_the_default_and_values_are_typed() -> None:
    options = parse(GeneratorOptions, {
        "kv_cache_blocks": " 64 ", "enable_chunked_prefill": "false", "cpu_threads": "3",
        "drain_timeout_seconds": "2.5", "engine_dir": "", "restart_revision": "4"})
    assert (options.kv_cache_blocks, options.enable_chunked_prefill, options.threads,
            options.drain_timeout_seconds, options.engine_dir) == (64, False, 3, 2.5, "")
    assert parse(GeneratorOptions, {"cpu_threads": "auto"}).threads == 0
    every_third = parse(GeneratorOptions, {"stream_interval": "3"})
    assert [every_third.interval(n) for n in (1, 64)] == [3, 3]
    assert parse(GeneratorOptions, {"tenant_weights": '{"gold": 3}'}).weights() == {"gold": 3.0}


@pytest.mark.parametrize(("cls", "params", "named"), [
    (FrontOptions, {"migraton_limit": "3"}, "unknown parameter migraton_limit"),
    (GeneratorOptions, {"kv_lease_seconds": "3"}, "unknown parameter kv_lease_seconds"),
    (GeneratorOptions, {"kv_cache_blocks": "many"}, "kv_cache_blocks must be an integer"),
    (GeneratorOptions, {"kv_cache_blocks": "0"}, "kv_cache_blocks must be at least 1"),
    (GeneratorOptions, {"max_num_batched_tokens": "-1"}, "max_num_batched_tokens must be at"),
    (PrefillOptions, {"max_num_batched_tokens": "many"}, "max_num_batched_tokens must be an"),
    (GeneratorOptions, {"enable_chunked_prefill": "yes"}, "enable_chunked_prefill must be true"),
    (GeneratorOptions, {"num_speculative_tokens": "-1"}, "num_speculative_tokens"),
    (GeneratorOptions, {"num_speculative_tokens": "2.5"}, "num_speculative_tokens"),
    (GeneratorOptions, {"cpu_threads": "0"}, "cpu_threads must be auto or at least 1"),
    (GeneratorOptions, {"cpu_threads": "many"}, "cpu_threads"),
    (GeneratorOptions, {"stream_interval": "0"}, "stream_interval must be auto or at least 1"),
    (DecodeOptions, {"stream_interval": "2.5"}, "stream_interval must be auto or at least 1"),
    (PrefillOptions, {"stream_interval": "2"}, "unknown parameter stream_interval"),
    (GeneratorOptions, {"tenant_weights": "[1]"}, "tenant_weights must be a JSON object"),
    (GeneratorOptions, {"tenant_weights": '{"a": "x"}'}, "tenant_weights"),
    (GeneratorOptions, {"tenant_weights": '{"a": 0}'}, "tenant_weights['a'] must be above 0"),
    (GeneratorOptions, {"kv_store": "on"}, "kv_store must be one of auto, off"),
    (PrefillOptions, {"kv_lease_seconds": "soon"}, "kv_lease_seconds must be a number"),
    (PrefillOptions, {"kv_lease_seconds": "nan"}, "kv_lease_seconds must be a number"),
    (PrefillOptions, {"kv_lease_seconds": "0"}, "kv_lease_seconds must be above 0"),
    (FrontOptions, {"max_waiting_requests": "0"}, "max_waiting_requests must be at least 1"),
    (FrontOptions, {"engine_check_interval_seconds": "-1"}, "engine_check_interval_seconds"),
    (KVStoreOptions, {"size_mb": "0"}, "size_mb must be at least 1"),
])
def test_a_bad_parameter_is_refused_by_name(cls: type, params: dict[str, str],
                                            named: str) -> None:
    with pytest.raises(OptionError, match=re.escape(named)):
        parse(cls, params)
