"""serve.sh's supervision: a tritonserver that dies on its own is started again, and why it
died is read from its log; one that keeps dying is given up on."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from python_backends.ops import launcher
from python_backends.ops.launcher import (
    PROJECT_ROOT,
    ServerOptions,
    TritonServer,
)
from tests.upstream import UPSTREAM_ABORT

ABORT_LOG = f"""I1130 loading prefill
terminate called after throwing an instance of '{UPSTREAM_ABORT}'
  what():  {UPSTREAM_ABORT}
Signal (6) received.
 0# 0x000056532DB7052D in tritonserver
"""


class DyingServer(TritonServer):
    """A 'tritonserver' that writes an abort to its log and exits 134, every time."""

    def __init__(self, log: Path) -> None:
        super().__init__(ServerOptions(log_file=log))
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        assert self.options.log_file is not None
        self.options.log_file.write_text(ABORT_LOG)
        self.process = subprocess.Popen(["sh", "-c", "exit 134"])

    def restart(self, timeout_s: float = 600.0) -> None:
        self.process = None
        self.start()


def test_the_abort_is_read_from_the_log(tmp_path: Path) -> None:
    server = DyingServer(tmp_path / "server.log")
    assert server.exit_reason() is None  # not started
    server.start()
    assert server.process is not None
    server.process.wait()
    reason = server.exit_reason()
    assert reason is not None and reason.startswith("exit code 134")
    assert UPSTREAM_ABORT in reason and "Signal (6)" in reason


def test_a_dying_server_is_restarted_until_it_dies_too_often(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    server = DyingServer(tmp_path / "server.log")
    server.start()
    assert launcher.supervise(server, max_restarts=3, window_s=60) == 134
    assert server.starts == 4  # the first start and three restarts
    out = capsys.readouterr().out
    assert out.count("restarting it") == 3 and "giving up" in out and UPSTREAM_ABORT in out


def test_a_role_loads_only_its_models() -> None:
    def loaded(o: ServerOptions) -> list[str]:
        return [a.split("=", 1)[1] for a in TritonServer(o).command()
                if a.startswith("--load-model=")]

    assert loaded(ServerOptions()) == ["*"]
    assert loaded(ServerOptions(role="prefill")) == ["kv_store", "prefill"]
    assert set(loaded(ServerOptions(role="front"))) == {"preprocessing", "front",
                                                        "postprocessing", "ensemble"}
    assert set(loaded(ServerOptions(role="aggregated"))) == {
        "kv_store", "preprocessing", "front", "postprocessing", "ensemble", "worker"}


def test_roles_are_checked_and_reach_the_models_environment() -> None:
    with pytest.raises(launcher.ServerError, match="needs --model-control explicit"):
        ServerOptions(role="prefill", model_control="none")
    with pytest.raises(launcher.ServerError, match="no front to call remote groups"):
        ServerOptions(role="decode", remote_groups=(("prefill", "127.0.0.1:1"),))
    ServerOptions(role="aggregated", remote_groups=(("prefill", "a:1"), ("decode", "b:2")))
    with pytest.raises(launcher.ServerError, match="unknown role 'router'"):
        ServerOptions(role="router")
    front = ServerOptions(role="front", api_key="k",
                          remote_groups=(("prefill", "a:1,b:2"), ("decode", "dns:decode:8001")))
    assert front.env() == {"LLM_ROLE": "front", "LLM_PREFILL_SERVERS": "a:1,b:2",
                           "LLM_DECODE_SERVERS": "dns:decode:8001", "LLM_API_KEY": "k",
                           "LLM_FAULT_INJECTION": "0"}


def test_fault_injection_is_off_unless_asked_for() -> None:
    # explicit either way: a variable left in the launching shell does not turn it on
    assert ServerOptions().env()["LLM_FAULT_INJECTION"] == "0"
    assert ServerOptions(fault_injection=True).env()["LLM_FAULT_INJECTION"] == "1"
    assert not launcher._parser().parse_args([]).fault_injection
    assert launcher._parser().parse_args(["--fault-injection"]).fault_injection


def test_the_restart_budget_counts_within_its_window() -> None:
    now = [0.0]
    budget = launcher.RestartBudget(max_restarts=2, window_s=10.0, clock=lambda: now[0])
    assert budget.spend() and budget.spend() and not budget.spend()
    now[0] = 10.5  # the first two left the window
    assert budget.spend()


def test_sigterm_unwinds_a_script_so_its_servers_are_stopped(tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    code = (
        "import os, signal, time\n"
        "from python_backends.ops.launcher import stop_on_sigterm\n"
        "stop_on_sigterm()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(10)\n"
        "finally:\n"
        f"    open({str(marker)!r}, 'w').write('stopped')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM and marker.read_text() == "stopped"
