"""A job's membership as one rank's client knows it: the epoch, the live ranks, and one
warning per change.

With ``fault_tolerance="continue"`` the daemons move a job to a new membership epoch when a
rank or a node is lost; the ``done`` of the first iteration of that epoch carries the epoch,
its ranks and what changed, in words (only to ranks not yet told, so each change arrives
once).
"""

from __future__ import annotations

import logging

from commd_protocol import Done, Registered

logger = logging.getLogger("commd_client")


class Membership:
    """Epoch 0 holds every rank of the job as it formed; ``observe`` follows the changes."""

    def __init__(self, job: str, world_size: int) -> None:
        self.job = job
        self.initial_world_size = world_size
        self.epoch = 0
        self.members: list[int] = list(range(world_size))
        # False for a helper job beside the gradient job (the buffer broadcast of the DDP
        # wrapper): the same change would otherwise be reported twice on every rank.
        self.log = True

    @property
    def world_size(self) -> int:
        """How many ranks the current epoch has."""
        return len(self.members)

    def joined(self, registered: Registered) -> None:
        """A rank that joined a running job: the epoch and ranks it joined (quietly: the
        change is this rank's own arrival)."""
        if registered.members is not None and registered.epoch > self.epoch:
            self.epoch, self.members = registered.epoch, sorted(set(registered.members))

    def observe(self, done: Done) -> bool:
        """Take ``done``'s membership when it names a newer epoch; True when it changed.

        Older or repeated epochs are ignored: every rank is told each change once, but a
        late ``done`` must never move a client back."""
        if done.members is None or done.epoch <= self.epoch:
            return False
        before = self.world_size
        self.epoch = done.epoch
        self.members = sorted(set(done.members))
        if self.log:
            logger.warning(
                "commd: job %r: membership epoch %d: %s; world size %d -> %d", self.job,
                self.epoch, done.change or "the membership changed", before, self.world_size,
            )
        return True
