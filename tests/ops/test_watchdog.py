"""The stub watchdog on a simulated clock with a fake repository and process table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from python_backends import procfs
from python_backends.ops.watchdog import StubWatchdog, expected_instances
from python_backends.procfs import STUB_BINARY, Stub, live_stubs
from tests.conftest import Clock


class FakeRepo:
    def __init__(self, configs: dict[str, dict[str, Any]], fail: bool = False) -> None:
        self.configs = configs
        self.restarted: list[str] = []
        self.fail = fail
        self.config_reads = 0

    def ready_models(self) -> list[str]:
        return list(self.configs)

    def config(self, model: str) -> dict[str, Any]:
        self.config_reads += 1
        return self.configs[model]

    def restart(self, model: str) -> None:
        if self.fail:
            raise RuntimeError("load refused")
        self.restarted.append(model)


def python_model(name: str, count: int = 1) -> dict[str, Any]:
    return {"name": name, "backend": "python",
            "instance_group": [{"name": f"{name}_0", "count": count, "kind": "KIND_CPU"}]}


def test_expected_instance_names() -> None:
    assert expected_instances(python_model("prefill", 2)) == {"prefill_0_0", "prefill_0_1"}
    unnamed = {"name": "w", "instance_group": [{"count": 1}, {"count": 2}]}
    assert expected_instances(unnamed) == {"w_0_0", "w_1_0", "w_1_1"}


def test_dead_stub_reloads_its_model_once_after_the_grace_period() -> None:
    repo = FakeRepo({"front": python_model("front"), "worker": python_model("worker"),
                     "ensemble": {"name": "ensemble", "platform": "ensemble"}})
    running = [Stub(10, "front", "front_0_0"), Stub(11, "worker", "worker_0_0")]
    clock, lines = Clock(), list[str]()
    dog = StubWatchdog(1, repo, grace_s=3.0, report=lines.append, stubs=lambda _pid: running,
                       clock=clock)
    assert dog.check() == []
    running.pop(0)  # the front's stub dies
    assert dog.check() == []  # a reload also leaves a gap for a moment
    clock.t = 2.9
    assert dog.check() == []
    clock.t = 3.0
    assert dog.check() == ["front"]
    assert repo.restarted == ["front"] and dog.restarts == [("front_0_0", "front")]
    assert any("front_0_0: stub process gone" in line for line in lines)
    running.append(Stub(12, "front", "front_0_0"))  # the reload started a new one
    clock.t = 10.0
    assert dog.check() == [] and repo.restarted == ["front"]


def test_instances_the_config_no_longer_lists_are_not_missed() -> None:
    repo = FakeRepo({"prefill": python_model("prefill", 2)})
    running = [Stub(1, "prefill", "prefill_0_0"), Stub(2, "prefill", "prefill_0_1")]
    clock = Clock()
    dog = StubWatchdog(1, repo, report=lambda _l: None, stubs=lambda _pid: running, clock=clock)
    dog.check()
    repo.configs["prefill"] = python_model("prefill", 1)  # scaled down
    running.pop()
    clock.t = 100.0
    assert dog.check() == [] and repo.restarted == []


def test_a_failed_reload_is_reported_once() -> None:
    repo = FakeRepo({"front": python_model("front")}, fail=True)
    clock, lines = Clock(), list[str]()
    dog = StubWatchdog(1, repo, grace_s=0.0, report=lines.append, stubs=lambda _pid: [],
                       clock=clock)
    dog.check()
    dog.check()
    failures = [line for line in lines if "failed" in line]
    assert len(failures) == 1 and "load refused" in failures[0]
    assert dog.restarts == []


def test_live_stubs_reads_the_process_table(tmp_path: Path) -> None:
    """A child process with a stub's name and argv layout is found; once it exits (a zombie
    until reaped) it is not."""
    stub = tmp_path / STUB_BINARY
    stub.symlink_to(sys.executable)  # python run under the stub's name
    model_file = tmp_path / "repo" / "front" / "1" / "model.py"
    model_file.parent.mkdir(parents=True)
    model_file.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([str(stub), str(model_file), "segment", "1", "1", str(os.getpid()),
                             "lib", "1", "front_0_0", "DEFAULT"])
    try:
        me = procfs.process(proc.pid)
        assert me is not None
        started = me.start_ticks
        assert _eventually(lambda: live_stubs(os.getpid()) ==
                           [Stub(proc.pid, "front", "front_0_0", started, "segment")])
        os.kill(proc.pid, signal.SIGKILL)  # not reaped: a zombie
        assert _eventually(lambda: live_stubs(os.getpid()) == [])
    finally:
        proc.kill()
        proc.wait()


def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_configs_are_read_again_only_when_an_instance_is_missing() -> None:
    repo = FakeRepo({"prefill": python_model("prefill", 1),
                     "ensemble": {"name": "ensemble", "platform": "ensemble"}})
    running = [Stub(1, "prefill", "prefill_0_0")]
    clock = Clock()
    dog = StubWatchdog(1, repo, report=lambda _l: None, stubs=lambda _pid: running, clock=clock)
    for _ in range(5):
        dog.check()
    assert repo.config_reads == 2  # once per model while nothing changes
    repo.configs["prefill"] = python_model("prefill", 2)  # scaled up: a second instance
    running.append(Stub(2, "prefill", "prefill_0_1"))
    dog.check()
    running.pop()  # ... whose stub dies: the cached config (one instance) would miss it
    dog.check()
    clock.t = 10.0
    assert dog.check() == ["prefill"] and repo.config_reads > 2


def test_a_lingering_old_stub_does_not_hide_the_death_of_its_successor() -> None:
    """An old version's stub can outlive a reload with the same instance name; when the stub
    that replaced it dies, the instance is dead all the same."""
    clock = [0.0]
    old, new = Stub(10, "front", "front_0_0", 100), Stub(20, "front", "front_0_0", 200)
    stubs = [old, new]
    repo = FakeRepo({"front": {"backend": "python", "name": "front",
                               "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}})
    dog = StubWatchdog(1, repo, grace_s=3.0, report=lambda _m: None,
                       stubs=lambda _pid: list(stubs), clock=lambda: clock[0])
    assert dog.check() == []
    stubs.remove(new)  # killed; the old one lingers
    assert dog.check() == []
    clock[0] = 5.0
    assert dog.check() == ["front"]
