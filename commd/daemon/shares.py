"""Fair shares: what one local user may make the daemon hold, beside what the daemon holds in all.

One daemon serves every user of its node, so every resource a client can make it hold has two
caps: one per daemon (its memory, its descriptors) and one per user, so that one user's flood,
or one user's runaway job, fills only that user's share and the others' ranks still connect,
hand over, register and run. The user is the kernel's word (SO_PEERCRED), never the message's:
on the ipc socket libzmq gives it as the frame property ``Peer-Address``
("<address>:<uid>:<gid>:<pid>"), on the buffer socket ``getsockopt(SO_PEERCRED)``.

Root is capped per daemon only: it can stop the daemon anyway, and on nodes where every job runs
as root (containers) a per-user cap would only shrink the daemon. A peer address that cannot be
parsed is one principal of its own (``UNKNOWN_UID``), capped like a user.

Each per-user cap is a quarter of (or less than) its daemon cap: four users at their caps fit,
and no one user can take the whole daemon.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from commd_protocol.status import ShareStatus

ROOT_UID = 0
UNKNOWN_UID = -1  # a peer whose credentials could not be read: one principal of its own


@dataclass(frozen=True)
class Cap:
    """How many of one kind of thing the daemon holds at most, in all and per user."""

    noun: str  # what is counted, plural: "ranks connected"
    per_daemon: int
    per_user: int
    advice: str  # what a refused client should do next


# Ranks that said hello. A node runs a few ranks per accelerator or core; 1024 is more than one
# user's jobs on one node need, and four users at their cap fit in the daemon's 4096.
SESSIONS = Cap("ranks connected", 4096, 1024, "end some ranks (goodbye) before starting more")
# Jobs on this node, in any state (each holds a formation deadline, a table, maybe buffers).
JOBS = Cap("jobs", 1024, 256, "finish some jobs before starting more")
# Buffers handed over and not registered yet: a rank hands over just before its register, so a
# buffer waits milliseconds; 64 covers one user starting 64 ranks at the same instant.
PENDING_HANDOVERS = Cap("buffers waiting for their register", 256, 64,
                        "register before handing over more")
# Open connections to the buffer socket: each lives one message (at most CONNECTION_S).
BUFFER_CONNECTIONS = Cap("open hand-over connections", 64, 16,
                         "hand over one buffer per connection and close it")
# Traces armed: one per job at a time, each bounded by the trace's timeout (trace.py); a user
# tracing more than 8 jobs at once on one node is a script gone wrong.
TRACES = Cap("traces running", 64, 8, "wait for a trace to finish")


def peer_uid(address: str | None) -> int:
    """The uid in libzmq's ``Peer-Address`` of an ipc connection ("<addr>:<uid>:<gid>:<pid>");
    UNKNOWN_UID when there is none or it does not parse."""
    if not address:
        return UNKNOWN_UID
    fields = address.rsplit(":", 3)
    if len(fields) != 4 or not all(field.isdigit() for field in fields[1:]):
        return UNKNOWN_UID
    return int(fields[1])


def who(uid: int) -> str:
    """A principal as a refusal names it."""
    return "a client whose uid could not be read" if uid == UNKNOWN_UID else f"uid {uid}"


class Shares:
    """Counts what each user holds of one kind against its cap (one owner: the module that
    holds the things counted calls ``take`` and ``give``)."""

    def __init__(self, cap: Cap) -> None:
        self.cap = cap
        self.total = 0
        self._held: Counter[int] = Counter()

    def held(self, uid: int) -> int:
        return self._held[uid]

    def refusal(self, uid: int) -> str:
        """Why ``uid`` may not take one more ("" if it may): the cap it reached and what to do."""
        cap = self.cap
        if self.total >= cap.per_daemon:
            return (f"this daemon holds {cap.per_daemon} {cap.noun} already, the most it holds "
                    f"for all users together; {cap.advice}")
        if uid != ROOT_UID and self._held[uid] >= cap.per_user:
            return (f"{who(uid)} holds {cap.per_user} {cap.noun} already, the most one user may "
                    f"(of {cap.per_daemon} on this daemon); {cap.advice}")
        return ""

    def status(self) -> ShareStatus:
        """What is held, in all and by uid, for ``commd status``."""
        return ShareStatus(kind=self.cap.noun, held=self.total, per_daemon=self.cap.per_daemon,
                           per_user=self.cap.per_user,
                           by_uid={str(uid): n for uid, n in sorted(self._held.items())})

    def take(self, uid: int) -> None:
        self.total += 1
        self._held[uid] += 1

    def give(self, uid: int) -> None:
        if self._held[uid] <= 0:  # a bug, not a client's doing: never go negative
            return
        self.total -= 1
        self._held[uid] -= 1
        if not self._held[uid]:
            del self._held[uid]
