"""A client of Triton's model-repository API: read a model's config, reload it with another
instance count or config variant, restart it. Used by the autoscaler, the stub watchdog, tests and
benchmarks."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any
from urllib.parse import urlparse

import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from python_backends.config import API_KEY_HEADER, ENGINE_GROUPS, GRPC_API_KEY_HEADER


def _force_reload(config: dict[str, Any], counter: str) -> None:
    """Bump the config parameter `counter`: Triton reloads a model whose config changed (new
    instances, new stub processes) but does nothing for an unchanged one."""
    params = config.setdefault("parameters", {})
    revision = int(params.get(counter, {}).get("string_value", "0") or 0)
    params[counter] = {"string_value": str(revision + 1)}


class TritonRepository:
    """Instance counts through Triton's model-repository API (the server must run with
    `--model-control-mode=explicit`, the launcher's default).
    Loading a model with a new config only adds or removes instances: the others keep serving,
    and a removed instance finishes its requests before it goes.

    Loads go over gRPC: in Triton 2.51 a load through the HTTP API holds an HTTP server thread
    for the whole load, and server-sent-event streams (`generate_stream`) served by that thread
    lose the responses produced meanwhile (their final event still arrives, so the output is
    silently cut short). Reads (config, index) stay on HTTP."""

    def __init__(self, url: str, grpc_url: str | None = None, timeout_s: float = 600.0,
                 api_key: str | None = None) -> None:
        """`grpc_url`: host:port of Triton's gRPC endpoint (default: the HTTP host, port 8001).
        `api_key`: for a server started with --api-key (the repository API is protected)."""
        self.url = url.rstrip("/")
        self.grpc_url = grpc_url or f"{urlparse(self.url).hostname}:8001"
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self._grpc_headers: dict[str, str] = {}
        if api_key:
            self.session.headers[API_KEY_HEADER] = api_key
            self._grpc_headers[GRPC_API_KEY_HEADER] = api_key

    def config(self, model: str) -> dict[str, Any]:
        r = self.session.get(f"{self.url}/v2/models/{model}/config", timeout=30)
        r.raise_for_status()
        return dict(r.json())

    def instance_count(self, model: str) -> int:
        return sum(int(g.get("count", 1)) for g in self.config(model).get("instance_group", []))

    def set_instance_count(self, model: str, count: int) -> None:
        config = self.config(model)
        current = self.instance_count(model)
        if count < current:
            # Removing instances in place crashed Triton 2.51 when one had a decoupled request
            # open, so shrinking reloads the model: new instances take new requests and the old
            # model is unloaded once its requests finish.
            _force_reload(config, "resize_revision")
        groups = config.get("instance_group") or [{"kind": "KIND_CPU"}]
        groups[0]["count"] = count
        for extra in groups[1:]:
            extra["count"] = 0
        config["instance_group"] = [g for g in groups if g["count"]]
        self.load(model, config, f"with {count} instances")

    def reloaded(self, model: str, **parameters: str) -> AbstractContextManager[None]:
        """A context: `model` reloaded with these config parameters set (see `variant`)."""
        return self.variant(model, partial(_set_parameters, parameters),
                            f"with {', '.join(sorted(parameters))} changed")

    def set_parameters(self, model: str, **parameters: str) -> None:
        """Reload `model` with these config parameters set, for good (a server of its own)."""
        config = self.config(model)
        _set_parameters(parameters, config)
        self.load(model, config, f"with {', '.join(sorted(parameters))} changed")

    @contextmanager
    def variant(self, model: str, change: Callable[[dict[str, Any]], None],
                what: str) -> Iterator[None]:
        """`model` reloaded with its config as `change` edits it, and with its original config
        again on leaving (benchmarks and tests that serve a variant for a while)."""
        original = self.config(model)
        config = copy.deepcopy(original)
        change(config)
        self.load(model, config, what)
        try:
            yield
        finally:
            self.load(model, original, "with its original config")

    def load(self, model: str, config: dict[str, Any], what: str = "") -> None:
        """(Re)load `model` with `config` (Triton's JSON form of config.pbtxt); the running
        version serves until the new one is ready."""
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            client.load_model(model, headers=self._grpc_headers, config=json.dumps(config),
                              client_timeout=self.timeout_s)
        except InferenceServerException as e:
            raise RuntimeError(f"loading {model} {what} failed: {e.message()}") from None
        finally:
            client.close()

    def ready_models(self) -> list[str]:
        r = self.session.post(f"{self.url}/v2/repository/index", data="{}", timeout=30)
        r.raise_for_status()
        return [m["name"] for m in r.json() if m.get("state") == "READY"]

    def served_groups(self) -> list[str]:
        ready = set(self.ready_models())
        return [g for g in ENGINE_GROUPS if g in ready]

    def restart(self, model: str) -> None:
        """Reload `model` with its current config: new instances (new stub processes) replace
        the old ones."""
        config = self.config(model)
        _force_reload(config, "restart_revision")
        self.load(model, config, "to restart it")


def _set_parameters(parameters: dict[str, str], config: dict[str, Any]) -> None:
    config.setdefault("parameters", {}).update(
        {key: {"string_value": value} for key, value in parameters.items()})
