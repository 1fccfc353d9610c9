"""Engine groups on other Triton servers: the front's calls to `prefill`, `decode` or `worker`
models that another server serves, over Triton's gRPC streaming endpoint.

A call carries the same typed message a local BLS call does (wire.EngineRequest) and yields the
same replies, so the front's routing, relaying and migration do not care where a group lives.
What differs is what the wire cannot carry across machines:
- cancellation: a remote engine cannot see the front's cancel board (shared memory of this
  node), so the call goes without one and the front cancels the gRPC stream instead, which
  Triton turns into the engine's `is_cancelled()`;
- an engine's death: a server that goes away breaks the stream (`Reply.unavailable`), and that
  server is left out of its group for `down_for_s`, so the retry or the migration goes to
  another server.

A group's servers are fixed addresses (`host:port,host:port`) or a DNS name (`dns:NAME:PORT`,
a Kubernetes headless service for instance) re-resolved every `resolve_every_s`, so pods that
come and go are picked up. Each call goes to the server with the fewest calls in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from python_backends.front.channel import Caller, EngineLost, Reply, batched
from python_backends.front.migration import MigrationReason, Moved
from python_backends.wire import EngineRequest, Message

# Triton answers like these mean the model is not there to serve (not loaded yet, unloading,
# its stub dead): the call can go to another server, unlike an error of the request itself.
UNAVAILABLE_MARKERS = ("is not healthy", "is not ready", "unknown model", "is not found",
                       "unavailable")


def _resolve(name: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    hosts = sorted({str(info[4][0]) for info in infos})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


@dataclass
class ServerSet:
    """The servers of one remote group, with the calls in flight on each."""

    spec: str
    resolve_every_s: float = 10.0
    down_for_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    resolver: Callable[[str, int], list[str]] = _resolve
    _addresses: list[str] = field(default_factory=list)
    _resolved_at: float = float("-inf")
    _down_until: dict[str, float] = field(default_factory=dict)
    _in_flight: dict[str, int] = field(default_factory=dict)
    _turn: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.spec = self.spec.strip()
        if self.spec.startswith("dns:"):
            name, _, port = self.spec[4:].rpartition(":")
            if not name or not port.isdigit():
                raise ValueError(f"{self.spec!r}: expected dns:NAME:PORT")
            self._dns: tuple[str, int] | None = (name, int(port))
        else:
            self._dns = None
            self._addresses = [a.strip() for a in self.spec.split(",") if a.strip()]
            bad = [a for a in self._addresses if not a.rpartition(":")[2].isdigit()]
            if not self._addresses or bad:
                raise ValueError(f"{self.spec!r}: expected host:port[,host:port...] or "
                                 "dns:NAME:PORT")

    def addresses(self) -> list[str]:
        """The group's servers now (a DNS name is resolved again when its answer is old; a
        failed lookup keeps the last answer)."""
        if self._dns is not None and self.clock() - self._resolved_at >= self.resolve_every_s:
            self._resolved_at = self.clock()
            with contextlib.suppress(OSError):
                self._addresses = self.resolver(*self._dns)
        return list(self._addresses)

    def up(self) -> list[str]:
        now = self.clock()
        return [a for a in self.addresses() if self._down_until.get(a, 0.0) <= now]

    def pick(self) -> str | None:
        """The up server with the fewest calls in flight (ties in turn); None when none is up.
        The caller reports the call's end with `done`."""
        with self._lock:
            up = self.up()
            if not up:
                return None
            turn = next(self._turn)
            best = min(range(len(up)), key=lambda i: (self._in_flight.get(up[i], 0),
                                                      (i - turn) % len(up)))
            self._in_flight[up[best]] = self._in_flight.get(up[best], 0) + 1
            return up[best]

    def done(self, address: str) -> None:
        with self._lock:
            self._in_flight[address] = max(0, self._in_flight.get(address, 0) - 1)

    def mark_down(self, address: str) -> None:
        with self._lock:
            self._down_until[address] = self.clock() + self.down_for_s


class RemoteGroup:
    """One engine model served by other Triton servers (a front.channel.Channel)."""

    steers_away = True  # a server that failed a call is left out for `down_for_s`

    def __init__(self, model: str, servers: ServerSet, headers: dict[str, str] | None = None,
                 check_every_s: float = 0.5) -> None:
        """`check_every_s`: how often a waiting call looks whether its client went away."""
        self.model = model
        self.servers = servers
        self.headers = headers or {}
        self.check_every_s = check_every_s
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def live(self) -> bool:
        return bool(self.servers.up())

    def stub(self, address: str) -> Any:
        """The gRPC stub of `address` (one channel per server, shared by its calls)."""
        from tritonclient.grpc import service_pb2_grpc

        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=[
                    ("grpc.max_send_message_length", -1),
                    ("grpc.max_receive_message_length", -1)])
                self._channels[address] = channel
        return service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def call(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> RemoteCall:
        """Start one call on the least busy up server (a call with no server up ends at once
        with an unavailable reply)."""
        address = self.servers.pick()
        if address is None:
            return RemoteCall.failed(f"{self.model}: no server of the group is up "
                                     f"({self.servers.spec})")
        return RemoteCall(self, address, inputs, outputs)

    def replies(self, message: EngineRequest, reply_type: type[Message],
                caller: Caller) -> Iterator[Reply]:
        """A call on another server. No cancel board crosses servers: when the client goes
        away the call's stream is cancelled, which the engine sees as a cancellation."""
        message = dataclasses.replace(message, cancel_board=None, cancel_ticket=0)
        call = self.call(message.encode(batched(reply_type)), reply_type.names())
        while True:
            if caller.check_cancelled():
                call.cancel()
            try:
                reply = call.next(timeout=self.check_every_s)
            except queue.Empty:
                continue
            if reply is RemoteCall.END:
                return
            if reply.unavailable:
                raise EngineLost(Moved(MigrationReason.INSTANCE_DOWN, reply.error))
            yield reply

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


def infer_request(model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> Any:
    """A ModelInferRequest of the wire's arrays."""
    from tritonclient.grpc import InferInput, InferRequestedOutput
    from tritonclient.grpc._utils import _get_inference_request
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, arr in inputs.items():
        tensor = InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        tensor.set_data_from_numpy(arr)
        tensors.append(tensor)
    request = _get_inference_request(
        model_name=model, inputs=tensors, model_version="", request_id="",
        outputs=[InferRequestedOutput(n) for n in outputs], sequence_id=0,
        sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=None)
    # Every call's end arrives, also as a final response without tensors.
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


class RemoteCall:
    """One engine call on a remote server, read by a thread into a queue (as serving.bls.Responses
    reads a local one), so that its caller can wait with a timeout and cancel."""

    END = object()

    def __init__(self, group: RemoteGroup | None, address: str,
                 inputs: dict[str, np.ndarray] | None = None, outputs: list[str] | None = None
                 ) -> None:
        self.group, self.address = group, address
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done = threading.Event()
        self._cancelled = False
        self._call: Any = None
        if group is not None:
            assert inputs is not None and outputs is not None
            request = infer_request(group.model, inputs, outputs)
            threading.Thread(target=self._read, args=(group, request), daemon=True,
                             name="remote-replies").start()

    @classmethod
    def failed(cls, message: str) -> RemoteCall:
        call = cls(None, "")
        call._queue.put(Reply(error=message, unavailable=True))
        call._queue.put(cls.END)
        return call

    def _requests(self, request: Any) -> Iterator[Any]:
        yield request
        self._done.wait()  # keep our side of the stream open until the replies end

    def _read(self, group: RemoteGroup, request: Any) -> None:
        from tritonclient.grpc import InferResult

        try:
            self._call = group.stub(self.address).ModelStreamInfer(
                self._requests(request), metadata=list(group.headers.items()) or None)
            if self._cancelled:
                self._call.cancel()
            for response in self._call:
                if response.error_message:
                    self._queue.put(Reply(error=response.error_message, unavailable=any(
                        m in response.error_message for m in UNAVAILABLE_MARKERS)))
                    continue
                result = InferResult(response.infer_response)
                arrays = {o.name: result.as_numpy(o.name)
                          for o in response.infer_response.outputs}
                self._queue.put(Reply(outputs=arrays))
                final = response.infer_response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
        except grpc.RpcError as e:
            if not self._cancelled:
                group.servers.mark_down(self.address)
                self._queue.put(Reply(error=f"{group.model} on {self.address}: "
                                            f"{e.code().name}: {e.details()}", unavailable=True))
        finally:
            self._done.set()
            group.servers.done(self.address)
            self._queue.put(self.END)

    def next(self, timeout: float) -> Any:
        """The next Reply, or END; raises queue.Empty after `timeout` seconds without one."""
        return self._queue.get(timeout=timeout)

    def cancel(self) -> None:
        """Cancel the stream: the remote engine sees its request cancelled and frees its KV.
        Once is enough: later calls do nothing."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()
        self._done.set()
