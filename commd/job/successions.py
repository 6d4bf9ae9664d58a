"""Where this daemon's tolerant jobs went when their coordinator was lost: per job id, the
lost coordinator's address and the node that took over from it.

A takeover changes a job's coordinator on the nodes that lived through it, but not the
command lines that started its ranks: a rank restarted by torchrun on a surviving node, or a
replacement on a fresh daemon started where the lost coordinator ran, still names the
launch-time address in ``COMMD_COORDINATOR``. What is kept here serves both:

- a new ``Job`` on this daemon for a job id seen taken over resolves the address its ranks
  name to the successor (``resolve``), so a survivor's restart rejoins where the job runs;
- once a daemon answers again at a lost address (this daemon's link there reconnects), it is
  told who coordinates each job lost there (``lost_at``; ``PeerSuccession``), and sends a
  join it gets for one of them there (``PeerRedirect``).

The entries outlive the jobs on this node (a restart comes after its job's ranks here are
gone), bounded by ``MAX_JOBS_KEPT``, oldest first out.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_JOBS_KEPT = 256
MAX_CHAIN = 16  # successive takeovers of one job followed by ``resolve``


class Successions:
    """Per job id: lost coordinator address → the address that took the job over."""

    def __init__(self, limit: int = MAX_JOBS_KEPT) -> None:
        self._limit = limit
        self._jobs: OrderedDict[str, dict[str, str]] = OrderedDict()

    def record(self, job: str, lost: str, successor: str) -> None:
        """``successor`` took ``job`` over from the coordinator at ``lost``."""
        if lost == successor:
            return
        steps = self._jobs.pop(job, {})
        steps[lost] = successor
        steps.pop(successor, None)  # coordinating again where it was lost before: no loop
        self._jobs[job] = steps
        while len(self._jobs) > self._limit:
            self._jobs.popitem(last=False)

    def resolve(self, job: str, address: str) -> str:
        """Where ``job`` is coordinated now for ranks that name ``address``: the last successor
        of a chain of takeovers from it, else ``address`` itself."""
        steps = self._jobs.get(job, {})
        for _ in range(MAX_CHAIN):
            successor = steps.get(address)
            if successor is None:
                break
            address = successor
        return address

    def lost_at(self, address: str) -> list[tuple[str, str]]:
        """(job, where it is coordinated now) for every job whose coordinator was lost at
        ``address``."""
        return [(job, self.resolve(job, address)) for job, steps in self._jobs.items()
                if address in steps]
