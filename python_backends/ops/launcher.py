"""Start, watch and stop the real Triton Inference Server shipped in the nvidia-pytriton wheel.

Used by scripts/serve.sh (as `python -m python_backends.ops.launcher`), the end-to-end tests and the
benchmarks, so every path starts the server the same way. The environment traps it handles are
described in docs/platform.md: the Python stub must sit in the backend directory, runs the virtual
environment of the first `python3` on PATH, and must link this interpreter's own libpython.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from python_backends import procfs
from python_backends.config import (
    API_KEY_ENV,
    API_KEY_HEADER,
    FAULT_INJECTION_ENV,
    FRONT_LOCAL_GROUPS,
    GRPC_API_KEY_HEADER,
    PROJECT_ROOT,
    ROLE_ENV,
    ROLES,
)
from python_backends.models import cpu_isa
from python_backends.net import free_port
from python_backends.ops.repository import TritonRepository
from python_backends.ops.watchdog import StubWatchdog

GATEWAY_PORT = 9000
MAX_RESTARTS, RESTART_WINDOW_S = 5, 600.0  # serve.sh restarts a dead server this often

# The models each role loads (docs/cluster.md). `all` is one whole server; `front` answers
# clients and sends engine work to the engine servers named by REMOTE_GROUP_ENVS.
FRONT_MODELS = ("preprocessing", "front", "postprocessing", "ensemble")
ROLE_MODELS = {
    "all": ("*",),
    "front": FRONT_MODELS,
    "prefill": ("kv_store", "prefill"),
    "decode": ("kv_store", "decode"),
    "worker": ("kv_store", "worker"),
    "aggregated": (*FRONT_MODELS, "kv_store", "worker"),
}
assert tuple(ROLE_MODELS) == ROLES
REMOTE_GROUP_ENVS = {group: f"LLM_{group.upper()}_SERVERS" for group in ("prefill", "decode",
                                                                         "worker")}
SHM_DIR = Path("/dev/shm")
# Protected by --api-key. Health and metadata stay open for load balancers and discovery.
RESTRICTED_APIS = (
    "inference", "model-repository", "model-config", "shared-memory", "statistics", "trace",
    "logging",
)


class ServerError(RuntimeError):
    pass


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind this process (SystemExit) where nothing else handles it, so that a
    script or test run killed that way stops the servers its `with TritonServer(...)` blocks
    and fixtures started, instead of leaving them running. From the main thread only, and only
    over the default action (serve.sh's own handler stays)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise ServerError("nvidia-pytriton is not installed (it ships the tritonserver binary)")
    return Path(spec.origin).parent / "tritonserver"


def prepare_backend_dir() -> Path:
    """Put the Python stub for this interpreter next to the Python backend; returns the
    backend directory to pass as --backend-directory."""
    root = pytriton_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"no Triton Python stub for Python {version} in {stub.parent.parent}")
    target = root / "backends" / "python" / stub.name
    if not target.is_file() or target.stat().st_size != stub.stat().st_size:
        shutil.copy2(stub, target)
    return root / "backends"


def server_env(engine_dir: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = cpu_isa.torch_environment({**os.environ, **(extra or {})})
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    libs = str(pytriton_dir().parent.parent / "nvidia_pytriton.libs")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libdir, libs, env.get("LD_LIBRARY_PATH", "")) if p
    )
    if engine_dir is not None:
        env["LLM_ENGINE_DIR"] = str(engine_dir.resolve())
    return env


@dataclass(frozen=True)
class ServerOptions:
    model_repository: Path = PROJECT_ROOT / "model_repository"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    engine_dir: Path | None = None
    log_file: Path | None = None  # None: inherit stdout/stderr
    exit_timeout_s: int = 15
    api_key: str | None = None  # when set, clients must send it in the x-api-key header
    # "explicit": the model-repository API may load, unload and resize models while serving
    # (the autoscaler resizes instance groups, the stub watchdog reloads a model whose stub
    # died); "none": it may not. Every model is loaded at start either way.
    model_control: str = "explicit"
    # Threads per Python model instance in Triton's parent process (`thread-pool-size`). Each
    # BLS call holds one until the call's first response, and every response a model sends
    # passes through one. Engines accept each call at once (serving.common.accepted), so no
    # thread waits for a queued request and the backend's default, 32, serves any queue depth;
    # every instance has its own pool, dead ones included (Triton 2.51 never frees those).
    python_threads: int = 32
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    role: str = "all"  # ROLE_MODELS
    # A front's engine groups on other servers: group -> "host:port,..." or "dns:NAME:PORT"
    # (front.remote), passed to its front model as REMOTE_GROUP_ENVS.
    remote_groups: tuple[tuple[str, str], ...] = ()
    # Clients may inject faults (`kv_fault`, `engine_fault`): for drills, the soak and the tests.
    fault_injection: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLE_MODELS:
            raise ServerError(f"unknown role {self.role!r} (one of {', '.join(ROLE_MODELS)})")
        if self.role != "all" and self.model_control != "explicit":
            raise ServerError(f"role {self.role} loads only its models: it needs "
                              "--model-control explicit")
        if self.remote_groups and self.role not in FRONT_LOCAL_GROUPS:
            raise ServerError(f"a {self.role} server has no front to call remote groups")

    def env(self) -> dict[str, str]:
        """What the server's models read from their environment: the role, the remote groups,
        the API key their calls to other servers carry, whether faults may be injected."""
        env = {ROLE_ENV: self.role, FAULT_INJECTION_ENV: "1" if self.fault_injection else "0"}
        env.update((REMOTE_GROUP_ENVS[group], spec) for group, spec in self.remote_groups)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        return env

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def repository(self) -> TritonRepository:
        """A client of this server's model-repository API."""
        return TritonRepository(self.http_url, self.grpc_address, api_key=self.api_key)


class TritonServer:
    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.process: subprocess.Popen[bytes] | None = None
        self._shm_before: set[str] = set()
        self.watchdog: StubWatchdog | None = None

    def command(self) -> list[str]:
        o = self.options
        return [
            str(pytriton_dir() / "bin" / "tritonserver"),
            f"--model-repository={o.model_repository}",
            f"--backend-directory={prepare_backend_dir()}",
            f"--cache-directory={pytriton_dir() / 'caches'}",
            f"--http-address={o.host}", f"--http-port={o.http_port}",
            f"--grpc-address={o.host}", f"--grpc-port={o.grpc_port}",
            f"--metrics-address={o.host}", f"--metrics-port={o.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={o.exit_timeout_s}",
            "--backend-config=python,shm-default-byte-size=4194304",
            "--backend-config=python,shm-growth-byte-size=4194304",
            f"--backend-config=python,thread-pool-size={o.python_threads}",
            # gRPC metadata x-tenant becomes the request parameter `x-tenant` (rate limits).
            # (Triton 2.51 forwards HTTP headers for /infer only, not /generate.)
            "--http-header-forward-pattern=^x-tenant$",
            "--grpc-header-forward-pattern=^x-tenant$",
            *self._auth_args(),
            *(["--model-control-mode=explicit",
               *(f"--load-model={model}" for model in ROLE_MODELS[o.role])]
              if o.model_control == "explicit" else []),
            *o.extra_args,
        ]

    def _auth_args(self) -> list[str]:
        key = self.options.api_key
        if not key:
            return []
        if any(c in key for c in ",:= \t\n"):
            raise ServerError("the API key must not contain ',', ':', '=' or whitespace")
        rule = f"{','.join(RESTRICTED_APIS)}:{API_KEY_HEADER}={key}"
        return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]

    def start(self) -> None:
        stop_on_sigterm()
        self._shm_before = set(os.listdir(SHM_DIR))
        out = open(self.options.log_file, "ab") if self.options.log_file else None  # noqa: SIM115
        self.process = subprocess.Popen(
            self.command(), env=server_env(self.options.engine_dir, self.options.env()),
            stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True,
        )

    def is_ready(self) -> bool:
        try:
            url = f"{self.options.http_url}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 300.0, progress: bool = False) -> None:
        deadline = time.monotonic() + timeout_s
        last_note = time.monotonic()
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode}")
            if self.is_ready():
                self._watch()
                return
            if progress and time.monotonic() - last_note > 10:
                print("[serve] waiting for the models to load ...", flush=True)
                last_note = time.monotonic()
            time.sleep(0.5)
        raise ServerError(f"server not ready after {timeout_s:.0f}s")

    def _watch(self) -> None:
        """Start the stub watchdog (once): a dead model stub gets its model reloaded."""
        if self.watchdog is not None or self.process is None:
            return
        repo = self.options.repository()
        self.watchdog = StubWatchdog(self.process.pid, repo, report=self._report)
        self.watchdog.start()

    def _report(self, line: str) -> None:
        if self.options.log_file is None:
            print(line, file=sys.stderr, flush=True)
            return
        with open(self.options.log_file, "a") as f:
            f.write(line + "\n")

    def exit_reason(self) -> str | None:
        """None while tritonserver runs; else its exit code and the abort lines of its log."""
        p = self.process
        if p is None or p.poll() is None:
            return None
        why = f"exit code {p.returncode}"
        if self.options.log_file is not None and self.options.log_file.exists():
            with self.options.log_file.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                tail = f.read().decode(errors="replace").splitlines()
            aborts = [line for line in tail if "terminate called" in line or
                      line.startswith(("Signal (", "  what():"))]
            if aborts:
                why += ": " + " / ".join(a.strip() for a in aborts[-3:])
        return why

    def restart(self, timeout_s: float = 600.0) -> None:
        """A fresh tritonserver on the same ports, after one that died (its stubs and shared
        memory cleaned up first)."""
        self.stop()
        self.start()
        self.wait_ready(timeout_s)

    def stop(self) -> None:
        """SIGTERM, wait for Triton to unload the models (it stops the stubs), then make sure
        no process of the group and no shared-memory region of this server is left behind."""
        if self.watchdog is not None:
            self.watchdog.stop()  # unloading is not dying
            self.watchdog = None
        p = self.process
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(self.options.exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p is not None:
            # Stubs outlive a server that hit its exit timeout; they hold shared memory.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            _wait_group_gone(p.pid)
        self.process = None
        remove_orphan_shm(set(os.listdir(SHM_DIR)) - self._shm_before)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def server_for(
    start: bool, url: str, metrics_url: str, engine_dir: Path, log_file: Path
) -> Iterator[tuple[str, str]]:
    """For benchmarks: yields (HTTP URL, metrics URL) of a server started on free ports for the
    duration when `start`, else of the given running server."""
    if not start:
        yield url, metrics_url
        return
    opts = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                         engine_dir=engine_dir, log_file=log_file)
    with TritonServer(opts) as server:
        server.wait_ready(progress=True)
        yield opts.http_url, opts.metrics_url


def _wait_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """Wait until no live (non-zombie) process of the group is left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(p.pgrp == pgid and p.running for p in procfs.processes()):
            return
        time.sleep(0.1)


def _mapped_paths() -> set[str]:
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(
                    line.split(maxsplit=5)[-1].strip() for line in f if "/dev/shm/" in line
                )
        except OSError:
            continue
    return mapped


def remove_orphan_shm(names: set[str]) -> None:
    """Remove Triton regions created during this server's life that no process maps any more."""
    candidates = [n for n in names if n.startswith("triton")]
    if not candidates:
        return
    mapped = _mapped_paths()
    for name in candidates:
        path = SHM_DIR / name
        if str(path) not in mapped:
            path.unlink(missing_ok=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Serve the model repository with Triton.")
    ap.add_argument("--host", default=os.environ.get("LLM_HOST", "127.0.0.1"))
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("LLM_HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("LLM_GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int,
                    default=int(os.environ.get("LLM_METRICS_PORT", 8002)))
    ap.add_argument("--engine", type=Path, default=None, help="engine directory")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                    help=f"require this key in the {API_KEY_HEADER} header (HTTP and gRPC) for "
                         "inference and control APIs; health stays open")
    ap.add_argument("--model-repository", type=Path, default=PROJECT_ROOT / "model_repository")
    ap.add_argument("--model-control", choices=("none", "explicit"),
                    default=os.environ.get("LLM_MODEL_CONTROL", "explicit"),
                    help="explicit (default): models can be reloaded while serving, by the "
                         "autoscaler and by the stub watchdog (which reloads a model whose stub "
                         "process died); none: the repository is fixed")
    ap.add_argument("--role", choices=ROLES, default=os.environ.get(ROLE_ENV, "all"),
                    help="all (default): the whole pipeline in this server; front: clients' "
                         "endpoints, engine groups on other servers (--prefill-servers ...); "
                         "prefill, decode, worker: that engine group only (docs/cluster.md)")
    for group, env in REMOTE_GROUP_ENVS.items():
        ap.add_argument(f"--{group}-servers", default=os.environ.get(env, ""),
                        help=f"the servers of the {group} group for this server's front: "
                             "host:port,... (gRPC) or dns:NAME:PORT")
    ap.add_argument("--fault-injection", action="store_true",
                    default=os.environ.get(FAULT_INJECTION_ENV) == "1",
                    help="let clients inject faults with the kv_fault and engine_fault request "
                         "parameters (drills; docs/disaggregation.md); refused otherwise")
    ap.add_argument("--gateway-port", type=int,
                    default=int(os.environ.get("LLM_GATEWAY_PORT", GATEWAY_PORT)),
                    help=f"the gateway's port (OpenAI API, docs/gateway.md; {GATEWAY_PORT}); "
                         "0: no gateway (engine-only roles never start one)")
    ap.add_argument("extra", nargs="*", help="extra tritonserver arguments (after --)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        try:
            cpu_isa.cap()
        except ValueError as e:
            raise ServerError(str(e)) from None
        opts = ServerOptions(
            model_repository=args.model_repository, host=args.host, http_port=args.http_port,
            grpc_port=args.grpc_port, metrics_port=args.metrics_port, engine_dir=args.engine,
            api_key=args.api_key, model_control=args.model_control, role=args.role,
            remote_groups=tuple((g, getattr(args, f"{g}_servers")) for g in REMOTE_GROUP_ENVS
                                if getattr(args, f"{g}_servers")),
            extra_args=tuple(args.extra), fault_injection=args.fault_injection,
        )
    except ServerError as e:
        print(f"[serve] error: {e}", file=sys.stderr, flush=True)
        return 2
    if opts.role not in FRONT_LOCAL_GROUPS:  # an engine-only role
        args.gateway_port = 0  # no ensemble here for a gateway to call
    server = TritonServer(opts)

    def start() -> ServerOptions:
        server.start()
        server.wait_ready(progress=True)
        return opts

    return serve_until_stopped("serve", start, lambda: _banner(opts, args.gateway_port),
                               lambda: supervise(server), server.stop, args.gateway_port)


def serve_until_stopped(tag: str, start: Callable[[], ServerOptions], banner: Callable[[], str],
                        watch: Callable[[], int], stop: Callable[[], None],
                        gateway_port: int) -> int:
    """A foreground serving script's life (serve.sh, serve_cluster.sh): `start` the servers
    (it returns the options of the one a gateway fronts), the gateway on `gateway_port` (0:
    none), print the `banner`, then `watch` until it returns or SIGINT / SIGTERM comes (one
    stop, however many signals); the gateway and the servers are stopped either way."""
    def on_signal(signum: int, _frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        print(f"\n[{tag}] {signal.Signals(signum).name}: stopping ...", flush=True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    gateway: subprocess.Popen[bytes] | None = None
    try:
        fronted = start()
        if gateway_port:
            gateway = start_gateway(fronted, gateway_port)
        print(banner(), flush=True)
        return watch()
    except KeyboardInterrupt:
        return 0
    except ServerError as e:
        print(f"[{tag}] error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if gateway is not None:
            stop_process(gateway)
        stop()
        print(f"[{tag}] stopped", flush=True)


@dataclass
class RestartBudget:
    """At most `max_restarts` restarts of a server within `window_s` seconds."""

    max_restarts: int = MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    _times: list[float] = field(default_factory=list)

    def spend(self) -> bool:
        """Take one restart; False when the window's are used up."""
        now = self.clock()
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


def supervise(server: TritonServer, max_restarts: int = MAX_RESTARTS,
              window_s: float = RESTART_WINDOW_S) -> int:
    """Wait on tritonserver; when it dies on its own, start it again (the gateway and clients
    see it come back), unless it died `max_restarts` times within `window_s`. Returns its exit
    code when giving up."""
    budget = RestartBudget(max_restarts, window_s)
    while True:
        assert server.process is not None
        code = server.process.wait()
        print(f"[serve] tritonserver died: {server.exit_reason()}", flush=True)
        if not budget.spend():
            print(f"[serve] it died {max_restarts + 1} times in {window_s / 60:.0f} min; "
                  "giving up", flush=True)
            return code
        print("[serve] restarting it ...", flush=True)
        server.restart()
        print("[serve] ready again", flush=True)


def start_gateway(o: ServerOptions, port: int, timeout_s: float = 120.0) -> subprocess.Popen[bytes]:
    """The gateway in front of this server, on `port`; returns once it answers /health."""
    args = ["--backend", f"{o.grpc_address},{o.metrics_url}"]
    if o.engine_dir is not None:
        args += ["--engine", str(o.engine_dir)]
    env = dict(os.environ)
    if o.api_key:
        env[API_KEY_ENV] = o.api_key  # clients' key at the gateway, and its key here
    return launch_gateway(args, o.host, port, env=env, timeout_s=timeout_s)


def launch_gateway(args: list[str], host: str, port: int, env: dict[str, str] | None = None,
                   log: Path | None = None, timeout_s: float = 120.0,
                   ready: tuple[int, ...] = (200,)) -> subprocess.Popen[bytes]:
    """`python -m python_backends.gateway ARGS` on host:port (its output to `log`, if given);
    returns once /health answers with a status in `ready` (503: no server in rotation yet)."""
    cmd = [sys.executable, "-m", "python_backends.gateway", *args, "--host", host, "--port",
           str(port), "--log-level", "warning"]
    out = log.open("wb") if log is not None else None
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT if out else None)
    deadline = time.monotonic() + timeout_s
    url = f"http://{host}:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"the gateway exited with code {proc.returncode}")
        if _http_status(url) in ready:
            return proc
        time.sleep(0.3)
    stop_process(proc)
    raise ServerError(f"the gateway did not answer on {url} in {timeout_s:.0f} s")


def _http_status(url: str) -> int | None:
    """The status a GET of `url` answers; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _banner(o: ServerOptions, gateway_port: int) -> str:
    if o.role not in FRONT_LOCAL_GROUPS:
        return f"""
[serve] ready: a {o.role} server ({', '.join(ROLE_MODELS[o.role])})
  gRPC     {o.host}:{o.grpc_port}   (give it to a front: --{o.role}-servers {o.host}:{o.grpc_port})
  HTTP     {o.http_url}   (health, model repository)
  metrics  {o.metrics_url}
  Ctrl-C stops the server.
"""
    auth = f"-H '{API_KEY_HEADER}: <key>' " if o.api_key else ""
    note = (f"  auth     HTTP header {API_KEY_HEADER}, gRPC metadata {GRPC_API_KEY_HEADER}"
            " (health stays open)\n") if o.api_key else ""
    gateway = (f"  gateway  http://{o.host}:{gateway_port}/v1   (OpenAI API: /v1/completions, "
               f"/v1/chat/completions)\n") if gateway_port else ""
    return f"""
[serve] ready
  HTTP     {o.http_url}   (/v2/models/ensemble/generate, /generate_stream)
  gRPC     {o.host}:{o.grpc_port}
  metrics  {o.metrics_url}
{gateway}{note}  CPU path {cpu_isa.describe()}
  try:
    curl -s -X POST {o.http_url}/v2/models/ensemble/generate {auth}\\
      -d '{{"text_input": "The capital of France is", "max_tokens": 16}}'
{_gateway_example(o, gateway_port)}  Ctrl-C stops the server.
"""


def _gateway_example(o: ServerOptions, port: int) -> str:
    if not port:
        return ""
    auth = "-H 'Authorization: Bearer <key>' " if o.api_key else ""
    return f"""    curl -s http://{o.host}:{port}/v1/chat/completions {auth}\\
      -H 'Content-Type: application/json' -d '{{"model": "smollm2", "max_tokens": 16,
      "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'
"""


if __name__ == "__main__":
    sys.exit(main())
