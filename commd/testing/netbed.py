"""A small test bed of network namespaces with rate-limited links (root only).

    with NetBed(nodes=3, rate="1gbit") as bed:
        bed.run(0, ["ip", "-br", "addr"])              # a command inside node 0's namespace
        server = bed.popen(1, [sys.executable, "server.py"])
        bed.set_rate("100mbit")                         # live, `tc qdisc change`
        bed.set_rate(None)                              # unshaped veth

Layout: one hub namespace holding a bridge ``br0``, and one namespace per node holding
``eth0`` (one end of a veth pair; the other end is a port of the bridge) with the address
``10.77.0.<node + 1>/24``. Every address lives inside namespaces this bed created, so no
traffic leaves them. Each node's link is shaped in both directions with ``tc qdisc … tbf rate
R burst B latency L``: on the node's ``eth0`` (what it sends) and on its bridge port (what it
receives), like a switch port of speed R. This kernel has no netem: there is no added delay.

Everything is torn down on exit, also on an error, Ctrl-C or SIGTERM: first the processes
started with ``popen`` (SIGTERM, then SIGKILL), then any process still inside one of the
bed's namespaces, then the namespaces (which takes their veths and the bridge with them).
Namespaces left by a bed whose process died (``kill -9``) are removed by the next bed.

``.venv/bin/python -m commd.testing.netbed --nodes 2 --rate 100mbit`` measures TCP throughput
between node 0 and node 1 at that rate and unshaped; it prints a message and exits 0 when not
root or when ``ip netns`` does not work here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

from commd.testing.processes import stop_process

SUBNET = "10.77.0"  # /24; node i is SUBNET.(i + 1)
PREFIX = "commdbed"  # namespace names: commdbed-<pid>-<tag>-<n0|n1|…|hub>
MIN_BURST_BYTES = 64 * 1024  # at least one GSO super-packet
BURST_SECONDS = 0.002  # default burst: 2 ms at the rate (256 KB at 1 Gbit/s)
DEFAULT_LATENCY = "50ms"  # how long a packet may queue in the tbf before it is dropped

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE = re.compile(r"^(?P<value>[0-9]*\.?[0-9]+)(?P<unit>[kmgt]?)bit$")


class NetBedUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, or `ip netns` failed)."""


def rate_bits_per_s(rate: str) -> float:
    """``"1gbit"`` → 1e9; accepts NUMBER[k|m|g|t]bit as tc does (SI prefixes)."""
    match = _RATE.match(rate.strip().lower())
    if not match:
        raise ValueError(f"rate {rate!r}: use NUMBER followed by bit, kbit, mbit, gbit or tbit")
    return float(match["value"]) * _UNITS[match["unit"]]


def default_burst(rate: str) -> int:
    return max(MIN_BURST_BYTES, int(rate_bits_per_s(rate) / 8 * BURST_SECONDS))


def available() -> tuple[bool, str]:
    """(True, "") when this process can create network namespaces, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if _which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def skip_unless_available() -> None:
    """Print why and exit 0 when network namespaces cannot be used here."""
    ok, why = available()
    if not ok:
        print(f"skipped: {why}")
        sys.exit(0)


def _which(tool: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return shutil.which(tool, path=path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete namespaces of beds whose process is gone; returns their names."""
    removed = []
    for name in list_namespaces():
        parts = name.split("-")
        if (
            len(parts) >= 3
            and parts[0] == PREFIX
            and parts[1].isdigit()
            and not _pid_alive(int(parts[1]))
        ):
            _kill_namespace_processes(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def _namespace_pids(name: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def _kill_namespace_processes(name: str, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, every process inside namespace ``name`` (all started by a bed)."""
    pids = _namespace_pids(name)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [p for p in pids if _pid_alive(p) and p in _namespace_pids(name)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class NetBed:
    """``nodes`` network namespaces on one bridge, each link shaped to ``rate`` (None: not)."""

    def __init__(
        self,
        nodes: int = 2,
        rate: str | None = "1gbit",
        *,
        burst: int | None = None,
        latency: str = DEFAULT_LATENCY,
    ) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be 1..250, not {nodes}")
        if rate is not None:
            rate_bits_per_s(rate)  # validate early
        self.nodes = nodes
        self.rate = rate
        self.burst = burst
        self.latency = latency
        base = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.hub = f"{base}-hub"
        self.namespaces = [f"{base}-n{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self._created: list[str] = []
        self._shaped: set[tuple[str, str]] = set()  # (namespace, device) with a tbf
        self._processes: list[subprocess.Popen[Any]] = []
        self._previous_handler: Any = None

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> NetBed:
        ok, why = available()
        if not ok:
            raise NetBedUnavailable(why)
        if threading_is_main():
            self._previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            remove_stale()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _build(self) -> None:
        self._netns_add(self.hub)
        self._ip(self.hub, "link", "set", "lo", "up")
        self._ip(self.hub, "link", "add", "br0", "type", "bridge")
        self._ip(self.hub, "link", "set", "br0", "up")
        for index, (name, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            self._netns_add(name)
            port = f"p{index}"
            self._ip(
                self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name
            )
            self._ip(self.hub, "link", "set", port, "master", "br0")
            self._ip(self.hub, "link", "set", port, "up")
            self._ip(name, "link", "set", "lo", "up")
            self._ip(name, "addr", "add", f"{address}/24", "dev", "eth0")
            self._ip(name, "link", "set", "eth0", "up")
        self.set_rate(self.rate)

    def close(self) -> None:
        """Stop our processes and delete our namespaces (idempotent, never raises)."""
        for process in reversed(self._processes):
            stop_process(process, grace_s=5.0)  # SIGTERM, then SIGKILL
        self._processes.clear()
        for name in reversed(self._created):
            with contextlib.suppress(Exception):
                _kill_namespace_processes(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._created.clear()
        self._shaped.clear()
        if self._previous_handler is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    # --- rate limits ---------------------------------------------------------------------------

    def set_rate(self, rate: str | None, node: int | None = None) -> None:
        """Shape every node's link (or one node's) to ``rate`` in both directions, live.

        An existing tbf is changed in place (`tc qdisc change`); ``None`` removes it.
        """
        targets = range(self.nodes) if node is None else [node]
        for index in targets:
            for namespace, device in ((self.namespaces[index], "eth0"), (self.hub, f"p{index}")):
                self._shape(namespace, device, rate)
        if node is None:
            self.rate = rate

    def _shape(self, namespace: str, device: str, rate: str | None) -> None:
        key = (namespace, device)
        if rate is None:
            if key in self._shaped:
                self._tc(namespace, "qdisc", "del", "dev", device, "root")
                self._shaped.discard(key)
            return
        burst = self.burst if self.burst is not None else default_burst(rate)
        verb = "change" if key in self._shaped else "add"
        self._tc(
            namespace,
            "qdisc",
            verb,
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            str(burst),
            "latency",
            self.latency,
        )
        self._shaped.add(key)

    def qdisc(self, node: int) -> str:
        """`tc qdisc show` of a node's eth0, for reports."""
        return self.run(node, ["tc", "qdisc", "show", "dev", "eth0"]).stdout.strip()

    # --- commands inside a namespace -----------------------------------------------------------

    def namespace(self, node: int) -> str:
        return self.namespaces[node]

    def address(self, node: int) -> str:
        return self.addresses[node]

    def argv(self, node: int, command: Sequence[str]) -> list[str]:
        """``command`` wrapped to run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *command]

    def run(
        self, node: int, command: Sequence[str], *, check: bool = True, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside a node's namespace to completion (text output captured)."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.argv(node, command), check=check, text=True, **kwargs)

    def popen(self, node: int, command: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a command inside a node's namespace; the bed stops it on exit if still up.

        `ip netns exec` execs the command, so the process's pid is the command's own.
        """
        process = subprocess.Popen(self.argv(node, command), **kwargs)
        self._processes.append(process)
        return process

    # --- helpers -------------------------------------------------------------------------------

    def _netns_add(self, name: str) -> None:
        _checked(["ip", "netns", "add", name])
        self._created.append(name)

    @staticmethod
    def _ip(namespace: str, *args: str) -> None:
        _checked(["ip", "-n", namespace, *args])

    @staticmethod
    def _tc(namespace: str, *args: str) -> None:
        _checked(["ip", "netns", "exec", namespace, "tc", *args])


def _checked(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# --- self-test: TCP throughput between two nodes ------------------------------------------------

_SINK = """
import socket, sys, time
listener = socket.socket(); listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind((sys.argv[1], 0)); listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept(); total = 0; start = None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    if start is None:
        start = time.perf_counter()
    total += len(chunk)
print(total, time.perf_counter() - start, flush=True)
"""

_SOURCE = """
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])):
    sock.sendall(block)
sock.close()
"""


def measure_throughput(bed: NetBed, megabytes: int, sender: int = 0, receiver: int = 1) -> float:
    """Bits per second of one TCP stream from node ``sender`` to node ``receiver``."""
    sink = bed.popen(
        receiver,
        [sys.executable, "-c", _SINK, bed.address(receiver)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sink.stdout is not None
    port = sink.stdout.readline().strip()
    bed.run(
        sender,
        [sys.executable, "-c", _SOURCE, bed.address(receiver), port, str(megabytes)],
        timeout=120,
    )
    total, seconds = sink.stdout.readline().split()
    sink.wait(10)
    return int(total) * 8 / float(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate", default="100mbit", help="tbf rate to test (tc syntax)")
    parser.add_argument(
        "--megabytes",
        type=int,
        default=0,
        help="bytes sent per measurement (default: ~2 s at the rate)",
    )
    args = parser.parse_args(argv)
    skip_unless_available()
    if args.nodes < 2:
        parser.error("the throughput test needs at least 2 nodes")
    megabytes = args.megabytes or max(4, int(rate_bits_per_s(args.rate) / 8 / 1e6 * 2))
    with NetBed(nodes=args.nodes, rate=args.rate) as bed:
        print(f"namespaces: {', '.join(bed.namespaces)} (hub {bed.hub})")
        print(f"node 0 eth0: {bed.qdisc(0)}")
        for rate in (args.rate, None):
            bed.set_rate(rate)
            size = megabytes if rate is not None else max(megabytes, 256)
            bits = measure_throughput(bed, size)
            print(f"rate {rate or 'unshaped'}: {bits / 1e6:,.0f} Mbit/s over {size} MB")
    leftover = [n for n in list_namespaces() if n.startswith(bed.hub.rsplit("-", 1)[0])]
    print("torn down" if not leftover else f"LEFT OVER: {leftover}")
    return 0 if not leftover else 1


if __name__ == "__main__":
    sys.exit(main())
