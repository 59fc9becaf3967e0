"""A real S3 server (moto, in server mode) on 127.0.0.1 and a fault-injecting TCP proxy in front of it.

Both listen on loopback ports chosen free at start; nothing outside this
machine is contacted. :class:`FaultProxy` forwards bytes unchanged, except
for the connections it is told to break:

* ``"500"``   — reads the request, answers ``500 InternalError``;
* ``"503"``   — reads the request, answers ``503 SlowDown`` (throttling);
* ``"stall"`` — reads the request and never answers (the client's read timeout fires);
* ``"reset"`` — reads the request head and resets the connection (RST);
* ``mode = "down"`` — every connection is reset at once (the store unreachable);
* ``slow_bps``  — forwarded uploads are throttled to that many bytes per second.

:meth:`FaultProxy.arm` queues faults for the next new connections and drops
the live ones, so the client's pooled keep-alive connections are replaced.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's S3 in server mode, in a thread of this process."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        self.server.start()
        for _ in range(200):  # until it accepts connections
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return self
            time.sleep(0.05)
        raise RuntimeError("moto server did not start")

    def stop(self) -> None:
        self.server.stop()


_BODIES = {
    "500": (b"500 Internal Server Error", b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"),
    "503": (b"503 Slow Down", b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"),
}


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port`` that breaks the connections it is told to."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.faults: collections.deque[str] = collections.deque()
        self.injected: list[str] = []
        self.mode = "pass"
        self.slow_bps: float | None = None
        self._live: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, *faults: str) -> None:
        with self._lock:
            self.faults.extend(faults)
        self.drop_all()

    def drop_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for s in live:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        self.drop_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                fault = "reset" if self.mode == "down" else (self.faults.popleft() if self.faults else None)
                if fault is not None:
                    self.injected.append(fault)
            threading.Thread(target=self._serve, args=(client, fault), daemon=True).start()

    @staticmethod
    def _read_request(client: socket.socket) -> None:
        """Read one request: its head, then Content-Length bytes of body (or until the client pauses)."""
        client.settimeout(5)
        data = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in data:
                piece = client.recv(65536)
                if not piece:
                    return
                data += piece
            head, _, body = data.partition(b"\r\n\r\n")
            length = None
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length is None:
                client.settimeout(0.3)
            while length is None or len(body) < length:
                piece = client.recv(1 << 20)
                if not piece:
                    return
                body += piece

    @staticmethod
    def _reset(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            s.close()

    def _serve(self, client: socket.socket, fault: str | None) -> None:
        if fault == "reset":
            if self.mode != "down":
                with contextlib.suppress(OSError):
                    client.settimeout(5)
                    client.recv(4096)
            self._reset(client)
            return
        if fault in _BODIES:
            self._read_request(client)
            status, body = _BODIES[fault]
            with contextlib.suppress(OSError):
                client.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\nContent-Length: "
                               + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            with contextlib.suppress(OSError):
                client.close()
            return
        if fault == "stall":
            self._read_request(client)
            client.settimeout(30)
            with contextlib.suppress(OSError):
                while client.recv(65536):  # until the client gives up and closes
                    pass
            with contextlib.suppress(OSError):
                client.close()
            return
        try:
            up = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            self._reset(client)
            return
        for s in (client, up):
            s.settimeout(None)
        with self._lock:
            self._live.update((client, up))
        t = threading.Thread(target=self._pump, args=(client, up, True), daemon=True)
        t.start()
        self._pump(up, client, False)
        t.join()
        with self._lock:
            self._live.difference_update((client, up))
        for s in (client, up):
            with contextlib.suppress(OSError):
                s.close()

    def _pump(self, src: socket.socket, dst: socket.socket, upload: bool) -> None:
        try:
            while True:
                piece = src.recv(65536 if not (upload and self.slow_bps) else 16384)
                if not piece:
                    break
                if upload and self.slow_bps:
                    time.sleep(len(piece) / self.slow_bps)
                dst.sendall(piece)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
