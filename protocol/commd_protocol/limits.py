"""Bounds of the integers that clients and peer daemons send: one place, used by the daemon's
checks of a client's messages (``commd.job.validation``) and of a peer's
(``commd.coordinator.validation``).

MessagePack carries integers up to 2**64 - 1 and Python never overflows, but what the daemon
does with them does: msgspec cannot encode an answer past 2**64 - 1 (a ``peer_plan`` for
iteration 2**64 - 1 + 3), numpy arrays are int64, comm rows carry iterations as float64, and
the kernel's pid_t is 32 bits. Every bound below is far above any real job and far below
where anything breaks, so a value past one is a bug or an attack, never a big job.
"""

from __future__ import annotations

# World sizes, ranks, node counts and node indices: a million ranks is beyond any cluster
# built so far; keeping rank lists of this size linear to check is the coordinator's job.
MAX_RANKS = 2**20

# Layers of one job: --max-layers may not exceed it (commd.daemon.settings). A ``ready`` lists
# each layer at most once, so its lists are bounded by it from the array's header, before any
# element is decoded: a 4 MiB ready of one-byte integers would otherwise build four million.
MAX_LAYERS = 2**20

# Ranks on one node: a daemon serves at most 4096 sessions (commd.daemon.sessions), so a node
# never has more ranks than this; a join or heartbeat listing more is not from a daemon.
MAX_LOCAL_RANKS = 4096

# Iterations, report rounds, plan versions and engine generations only ever count up by one.
# 2**53 is exact in float64 (comm rows carry the iteration as a float) and leaves room for the
# coordinator's ``iteration + 1 + DECISION_LAG`` in int64: at a million iterations a second
# it lasts 285 years.
MAX_COUNT = 2**53

# Elements of one layer: 2**40 elements are 4 TiB of float32, past any one tensor; times the
# most layers a 4 MiB frame can list (~400,000), sums stay below 2**63.
MAX_LAYER_ELEMENTS = 2**40

# A process id: the kernel's pid_t is 32 bits, and pidfd_open refuses anything larger.
MAX_PID = 2**31 - 1

# TCP ports.
MAX_PORT = 65535

# A byte offset into one device allocation (a CUDA IPC handle's): 2**48 bytes is the whole
# address space GPUs map today; the daemon adds it to a device pointer.
MAX_BYTE_OFFSET = 2**48

# A GPU's index as a rank sees it (-1: none), shown in messages only.
MAX_DEVICE_INDEX = 2**16


def count_problem(name: str, value: int, minimum: int = 0) -> str:
    """'' when ``value`` is a count in [minimum, MAX_COUNT], else what is wrong, naming it."""
    if minimum <= value <= MAX_COUNT:
        return ""
    return f"{name} {value} is outside {minimum}..2**53"


def ranks_bound_problem(name: str, value: int, minimum: int = 1) -> str:
    """'' when ``value`` (a world size, a node count) is in [minimum, MAX_RANKS]."""
    if minimum <= value <= MAX_RANKS:
        return ""
    return f"{name} {value} is outside {minimum}..{MAX_RANKS} (2**20)"
