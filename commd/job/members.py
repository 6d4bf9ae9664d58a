"""The local ranks of one job on this node: who said hello, what each registered, who left."""

from __future__ import annotations

from commd.job.state import JobError, LocalRank
from commd_protocol import ErrorCode, Hello, Register
from commd_protocol.agreement import describe_difference

# Every rank of a job on a node must say the same of these as the first one did.
_SHARED_FIELDS = ("world_size", "local_world_size", "coordinator")


class Members:
    """The local ranks of one job on this node, by local rank: each hello checked against the
    first (world size, local world size, coordinator) and against the ranks already here, a
    replacement put in a lost rank's place, and what the ranks registered."""

    def __init__(self, first: Hello) -> None:
        self.job = first.job
        self._first = first
        self.ranks: dict[int, LocalRank] = {}  # by local rank

    def check(self, hello: Hello) -> None:
        """JobError (MISMATCH, naming both ranks) when ``hello`` contradicts the ranks here."""
        self._check_shared(hello)
        same = self.ranks.get(hello.local_rank)
        if same is not None:
            raise JobError(
                f"local rank {hello.local_rank} of job {self.job!r} is already connected "
                f"(rank {same.rank}, pid {same.pid}); rank {hello.rank} (pid {hello.pid}) says "
                "the same local rank: check LOCAL_RANK", ErrorCode.MISMATCH)
        same = next((r for r in self.ranks.values() if r.rank == hello.rank), None)
        if same is not None:
            raise JobError(
                f"rank {hello.rank} of job {self.job!r} is already connected (local rank "
                f"{same.local_rank}, pid {same.pid}); local rank {hello.local_rank} (pid "
                f"{hello.pid}) says the same rank: check RANK", ErrorCode.MISMATCH)

    def _check_shared(self, hello: Hello) -> None:
        first = self._first
        for name in _SHARED_FIELDS:
            if getattr(hello, name) != getattr(first, name):
                raise JobError(
                    f"rank {hello.rank} (pid {hello.pid}) says {name}={getattr(hello, name)!r} "
                    f"but rank {first.rank} (pid {first.pid}) said {name}="
                    f"{getattr(first, name)!r} for job {self.job!r}; every rank must agree",
                    ErrorCode.MISMATCH,
                )

    def replace(self, identity: bytes, hello: Hello) -> LocalRank:
        """A replacement for a local rank that is gone from a running tolerant job (its node
        runs on with the others): it takes that rank's place, the same rank and local rank.
        JobError (MISMATCH) when ``hello`` names no gone rank of this node."""
        self._check_shared(hello)
        gone = self.ranks.get(hello.local_rank)
        if gone is None or gone.rank != hello.rank:
            raise JobError(
                f"job {self.job!r} runs already, and rank {hello.rank} (local rank "
                f"{hello.local_rank}) was not one of its ranks on this node: a replacement "
                "takes a lost rank's place, with its rank and local rank", ErrorCode.MISMATCH)
        if not gone.left:
            what = "waits to join" if gone.rejoining else "is live"
            raise JobError(
                f"rank {hello.rank} of job {self.job!r} {what} on this node (pid {gone.pid}); "
                f"a replacement takes only a lost rank's place", ErrorCode.MISMATCH)
        member = LocalRank(identity, hello.rank, hello.local_rank, hello.pid, rejoining=True)
        self.ranks[hello.local_rank] = member
        return member

    def add(self, identity: bytes, hello: Hello) -> LocalRank:
        """A new local rank; JobError (MISMATCH) when it contradicts the ones before."""
        self.check(hello)
        member = LocalRank(identity, hello.rank, hello.local_rank, hello.pid)
        self.ranks[hello.local_rank] = member
        return member

    def in_order(self) -> list[LocalRank]:
        """By local rank: the order of the buffers in the data plane."""
        return [self.ranks[index] for index in sorted(self.ranks)]

    def first_registration(self) -> Register:
        """The registration of the lowest registered local rank (every rank agrees with it;
        a replacement that has not registered yet may hold a lower place)."""
        registration = next(r.registration for r in self.in_order() if r.registration)
        assert registration is not None
        return registration

    @property
    def sizes(self) -> list[int]:
        """Elements of each registered layer, forward order (every rank registered the same)."""
        return [layer.size for layer in self.first_registration().layers]

    @property
    def rows(self) -> list[int]:
        """Rows of each registered layer's matrix view, forward order, as ``sizes``: shape[0]
        of a tensor of 2 or more dimensions, 0 for a vector or where the client did not say
        (never compressed low-rank). A nonzero one divides its size (validated)."""
        return [layer.rows for layer in self.first_registration().layers]

    def live_registration(self) -> Register | None:
        """The registration of a live rank that is not a replacement waiting to join."""
        return next((r.registration for r in self.in_order()
                     if r.registration and not r.left and not r.rejoining), None)

    def any_registration(self) -> Register | None:
        return next((r.registration for r in self.ranks.values() if r.registration), None)

    @property
    def complete(self) -> bool:
        """Every local rank has said hello and registered."""
        return len(self.ranks) == self._first.local_world_size and all(
            r.registration is not None for r in self.ranks.values())

    def disagreement(self, member: LocalRank) -> str:
        """'' when ``member``'s registration agrees with the lowest registered rank's, else
        the difference, naming both ranks."""
        first = next(r for r in sorted(self.ranks.values(), key=lambda r: r.rank)
                     if r.registration)
        if first is member:
            return ""
        assert first.registration is not None and member.registration is not None
        problem = describe_difference(first.registration, member.registration)
        if not problem:
            return ""
        return f"ranks {first.rank} and {member.rank} registered different layers: {problem}"

    def gone(self) -> list[int]:
        """The ranks that closed or vanished."""
        return [r.rank for r in self.ranks.values() if r.left]

    @property
    def finished(self) -> bool:
        return all(r.left for r in self.ranks.values())

    def waiting(self) -> bool:
        """A rank still here waits for an iteration."""
        return any(r.waiting is not None for r in self.ranks.values() if not r.left)
