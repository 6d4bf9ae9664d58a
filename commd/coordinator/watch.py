"""The coordinator's watch over one job: which nodes are alive, and whether ranks stall.

Every node of a job heartbeats every few seconds (``PeerHeartbeat``) with where its iteration
stands: how long it has waited for marks of its local ranks, and which ranks have not marked
which layer. A node silent for ``peer_timeout_s`` is named and the job aborted. When some ranks
have marked what others have not, for ``stall_warn_s``, the stall is named once (the log, and
every node's status and waiting ranks through ``PeerStatus``); Horovod's stall inspector does
the same after 60 s. Whatever ``stall_warn_s`` is, who the job waits for goes to every node
(``PeerStatus.waiting_for``), so that a rank whose own wait times out first names them too.
Pure bookkeeping: the coordinator sends what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commd_protocol import PeerHeartbeat, PeerJoin
from commd_protocol.peer import NAME_UNMARKED_AFTER_S, describe_unmarked


@dataclass
class NodeWatch:
    """One node of a job as the watch sees it: when it was last heard and its last heartbeat."""

    heard_at: float  # the node's last message for this job (monotonic)
    beat: PeerHeartbeat | None = None


@dataclass
class Stall:
    """A stall named: the iteration and the ranks that have not marked (a new pair is a new
    stall), its words, and how long it has lasted."""

    key: tuple[int, tuple[int, ...]]  # (iteration, the ranks that have not marked)
    message: str
    seconds: float


@dataclass
class JobWatch:
    """The watch over one job: every node's ``NodeWatch``, when ``PeerStatus`` last went out, and
    the stall in force."""

    nodes: dict[bytes, NodeWatch] = field(default_factory=dict)
    status_at: float = 0.0  # when PeerStatus last went out
    stall: Stall | None = None

    def heard(self, node: bytes, now: float, beat: PeerHeartbeat | None = None) -> None:
        watch = self.nodes.setdefault(node, NodeWatch(now))
        watch.heard_at = now
        if beat is not None:
            watch.beat = beat

    def marks_pending(self) -> bool:
        """Some node's last heartbeat says it waits for marks of its ranks."""
        return any(w.beat is not None and w.beat.missing for w in self.nodes.values())

    def waiting_for(self, joins: dict[bytes, PeerJoin]) -> str:
        """The ranks that nodes have waited for past NAME_UNMARKED_AFTER_S by their last
        heartbeat, in words; "" when none. Unlike a stall, whatever ``stall_warn_s`` is."""
        index = {node: i for i, node in enumerate(_node_order(joins))}
        rows = []
        for node, watch in self.nodes.items():
            beat, join = watch.beat, joins.get(node)
            if beat is None or join is None or beat.waiting_s < NAME_UNMARKED_AFTER_S:
                continue
            where = f"node {index[node]}, {join.host}"
            for rank, layer in beat.missing:
                name = join.layers[layer].name if 0 <= layer < len(join.layers) else "?"
                rows.append((rank, where, layer, name, beat.waiting_s))
        return describe_unmarked(rows)

    def silent_nodes(self, joins: dict[bytes, PeerJoin], now: float,
                     timeout_s: float) -> list[bytes]:
        """The nodes of the job silent past ``timeout_s``."""
        return [node for node in _node_order(joins)
                if node in self.nodes and now - self.nodes[node].heard_at > timeout_s]

    def silent(self, joins: dict[bytes, PeerJoin], now: float, timeout_s: float) -> str:
        """'' unless a node of the job has been silent past ``timeout_s``; else who."""
        order = _node_order(joins)
        for index, node in enumerate(order):
            watch = self.nodes.get(node)
            silent = now - watch.heard_at if watch else 0.0
            if silent > timeout_s:
                join = joins[node]
                return (f"node {index} ({join.host}, ranks {join.ranks[:20]}) has sent nothing "
                        f"for {silent:.0f}s: its daemon stopped, or the network to it is down")
        return ""

    def update_stall(self, joins: dict[bytes, PeerJoin], warn_s: float) -> Stall | None:
        """The job's stall now (None: none); a new one replaces ``self.stall``, whose change
        the caller logs."""
        beats = [(joins[node], w.beat) for node, w in self.nodes.items()
                 if w.beat is not None and node in joins]
        missing = [(rank, layer, join, beat) for join, beat in beats
                   for rank, layer in beat.missing]
        everyone = {rank for join in joins.values() for rank in join.ranks}
        absent = {rank for rank, _, _, _ in missing}
        waited = max((beat.waiting_s for _, _, _, beat in missing), default=0.0)
        if not missing or not everyone - absent or waited < warn_s:
            self.stall = None
            return None
        iteration = min(beat.iteration for _, _, _, beat in missing)
        key = (iteration, tuple(sorted(absent)))
        if self.stall is None or self.stall.key != key:
            self.stall = Stall(key, _describe(missing, everyone - absent, iteration, warn_s),
                               waited)
        self.stall.seconds = waited
        return self.stall


def _node_order(joins: dict[bytes, PeerJoin]) -> list[bytes]:
    """The job's nodes by their lowest rank: node i of every message the coordinator words."""
    return sorted(joins, key=lambda node: min(joins[node].ranks))


def _describe(missing: list[tuple[int, int, PeerJoin, PeerHeartbeat]], marked: set[int],
              iteration: int, warn_s: float) -> str:
    parts = []
    for rank, layer, join, _ in sorted(missing, key=lambda row: row[0])[:10]:
        name = join.layers[layer].name if 0 <= layer < len(join.layers) else "?"
        parts.append(f"rank {rank} (on {join.host}) has not marked layer {layer} ({name!r})")
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    return (f"stalled in iteration {iteration} for over {warn_s:g}s: {'; '.join(parts)}{more}; "
            f"ranks {sorted(marked)[:20]} have marked theirs")
