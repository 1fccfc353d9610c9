"""Restarts Python model instances whose stub process died.

Why it exists: Triton's Python backend never restarts the stub of a decoupled model. If one
dies (a crash, the OOM killer, a stray signal), every later request to that instance fails with
"Stub process '<instance>' is not healthy" until the model is reloaded; for the `front`
that is every request the server gets. The watchdog notices the missing process and reloads its
model through the model-repository API (explicit model control), which starts a new stub; the
other models, and requests in flight on them, are untouched. (Requests the dead stub held are
not failed by Triton; their clients wait until their own timeout.)

A stub is a child process of tritonserver running `triton_python_backend_stub`; its argv holds
the model file and the instance name (for example `front_0_0`). An instance is expected when
its model is READY and the model's config lists it; it is dead when no live (non-zombie) stub
carries its name for `grace_s` (a reload starts the new stubs before the model turns READY with
the new config, so a reload never looks like a death).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from python_backends.procfs import Stub, live_stubs

log = logging.getLogger(__name__)
def expected_instances(config: dict[str, Any]) -> set[str]:
    """Instance names Triton gives a model's instance groups: `<group name>_<index>`."""
    model = config["name"]
    names: set[str] = set()
    for g, group in enumerate(config.get("instance_group") or []):
        name = group.get("name") or f"{model}_{g}"
        names.update(f"{name}_{i}" for i in range(int(group.get("count", 1))))
    return names


class Repository(Protocol):
    def ready_models(self) -> list[str]: ...

    def config(self, model: str) -> dict[str, Any]: ...

    def restart(self, model: str) -> None: ...


class StubWatchdog:
    """Call `check` periodically (or `start` a thread that does): each dead instance's model is
    reloaded once; `restarts` records (instance, model) for every reload made."""

    def __init__(
        self, server_pid: int, repo: Repository, grace_s: float = 3.0,
        report: Callable[[str], None] = log.warning,
        stubs: Callable[[int], list[Stub]] = live_stubs,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.server_pid = server_pid
        self.repo = repo
        self.grace_s = grace_s
        self.report = report
        self._stubs = stubs
        self._clock = clock
        self._missing_since: dict[str, float] = {}
        self._configs: dict[str, dict[str, Any]] = {}  # READY models' configs, as last read
        self._failed: set[str] = set()  # instances whose reload failed: reported once
        self._newest: dict[str, int] = {}  # instance -> start time of its newest stub seen
        self.restarts: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> list[str]:
        """One look; returns the models reloaded."""
        stubs = self._stubs(self.server_pid)
        now = self._clock()
        dead: dict[str, list[str]] = {}
        ready = self.repo.ready_models()
        self._configs = {m: c for m, c in self._configs.items() if m in ready}
        for model in ready:
            running = self._current(stubs, model)
            config = self._configs.get(model)
            if config is None or (config.get("backend") == "python"
                                  and expected_instances(config) != running):
                # First look, or its stubs differ from what its config said: read it again
                # (a reload may have changed the instance groups).
                config = self._configs[model] = self.repo.config(model)
            if config.get("backend") != "python":
                continue
            for instance in expected_instances(config):
                if instance in running:
                    self._missing_since.pop(instance, None)
                    self._failed.discard(instance)
                    continue
                since = self._missing_since.setdefault(instance, now)
                if now - since >= self.grace_s and instance not in self._failed:
                    dead.setdefault(model, []).append(instance)
        for model, instances in dead.items():
            self.report(f"[watchdog] {', '.join(sorted(instances))}: stub process gone; "
                        f"reloading {model}")
            try:
                self.repo.restart(model)
            except Exception as e:
                self.report(f"[watchdog] reloading {model} failed (the instance stays down "
                            f"until the model is reloaded or the server restarted): {e}")
                self._failed.update(instances)
                continue
            for instance in instances:
                self._missing_since.pop(instance, None)
                self.restarts.append((instance, model))
            self.report(f"[watchdog] {model} reloaded")
        return list(dead)

    def _current(self, stubs: list[Stub], model: str) -> set[str]:
        """The instances of `model` whose newest stub runs. An old version's stub can linger
        with the same instance name (its version cannot unload while Triton holds one of its
        requests); it must not hide the death of the stub that replaced it."""
        running = set()
        for stub in stubs:
            if stub.model != model:
                continue
            newest = self._newest.get(stub.instance, 0)
            if stub.started >= newest:
                self._newest[stub.instance] = stub.started
                running.add(stub.instance)
        return running

    def start(self, interval_s: float = 1.0) -> None:
        def run() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.check()
                except Exception as e:  # the server may be starting or stopping
                    log.debug("watchdog check failed: %s", e)

        self._thread = threading.Thread(target=run, name="stub-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
