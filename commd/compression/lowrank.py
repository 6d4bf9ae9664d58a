"""PowerSGD's arithmetic at node level: which layers are compressed, their Q matrices, the
orthogonalisation, and the two products around the two all-reduces (Vogels, Karimireddy,
Jaggi, "PowerSGD", NeurIPS 2019; torch's ``powerSGD_hook`` is the reference semantics).

Pure numpy, no I/O; the collectives and the order of a group's steps are in
``commd.job.lowrank``. A layer of ``rows`` > 0 is viewed as a ``rows × size/rows`` matrix M
(torch's ``tensor.view(shape[0], -1)``) and compressed at rank r = min(rows, cols, rank)
where that sends at least ``min_rate`` times less than M; other layers (vectors, small
matrices) are all-reduced as they are, in the same collective as the P matrices.

One iteration of a group, every node the same steps in the same order:

1. M = S + E (the node's sum of its ranks, plus its error, E = 0 at the start);
2. P = M Q per matrix, Q orthogonal (warm: last iteration's, else fresh from the seed);
   one all-reduce carries every P and the uncompressed layers' values;
3. P orthogonalised; Q = Mᵀ P; one all-reduce carries every Q;
4. the group's sum is P Qᵀ (and the uncompressed layers' sum); E = M − share · sum, where
   ``share`` = the node's ranks / the job's ranks (torch's error: a rank's input minus the
   average it receives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from commd.compression.spec import LowRankSpec

__all__ = [
    "LOW_RANK",
    "GroupForm",
    "MatrixLayer",
    "form_group",
    "initial_q",
    "layer_wire_elements",
    "orthogonalize",
    "should_compress",
]

LOW_RANK = "lowrank"  # a plan's exchange for a PowerSGD group


@dataclass(frozen=True)
class MatrixLayer:
    """A compressed layer of a group: where it lies and its factors' places."""

    layer: int  # forward-order index
    start: int  # element offset in the group's span
    rows: int
    cols: int
    rank: int
    p_at: int  # element offset of its P in the first all-reduce's buffer
    q_at: int  # element offset of its Q in the second all-reduce's buffer

    @property
    def size(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class GroupForm:
    """How one group of a plan travels under PowerSGD."""

    matrices: tuple[MatrixLayer, ...]
    vectors: tuple[tuple[int, int], ...]  # (offset in the group's span, elements), uncompressed
    vector_elements: int  # they lead the first all-reduce's buffer
    first_elements: int  # uncompressed values + every P
    second_elements: int  # every Q

    @property
    def wire_elements(self) -> int:
        """Elements all-reduced per iteration (both collectives)."""
        return self.first_elements + self.second_elements


def should_compress(rows: int, cols: int, rank: int, min_rate: float) -> bool:
    """torch's ``_should_compress``: (rows + cols)·r·min_rate < rows·cols."""
    return (rows + cols) * rank * min_rate < rows * cols


def layer_wire_elements(size: int, rows: int, spec: LowRankSpec) -> int:
    """Elements one layer puts on the wire per iteration: (rows + cols)·r where compressed,
    else all of them."""
    if rows > 0 and size % rows == 0:
        cols = size // rows
        rank = min(rows, cols, spec.rank)
        if should_compress(rows, cols, rank, spec.min_rate):
            return (rows + cols) * rank
    return size


def form_group(layers: Sequence[int], sizes: Sequence[int], rows: Sequence[int],
               offsets: Sequence[int], span_start: int, spec: LowRankSpec) -> GroupForm:
    """The form of a group of ``layers`` (forward indices) whose span starts at element
    ``span_start``; ``offsets``: each layer's element offset in the flat buffer; ``rows``:
    each layer's matrix rows (0: a vector)."""
    matrices: list[MatrixLayer] = []
    vectors: list[tuple[int, int]] = []
    compressed: list[tuple[int, int, int, int]] = []
    for layer in sorted(layers, key=lambda i: offsets[i]):  # in buffer order
        start, size = offsets[layer] - span_start, sizes[layer]
        layer_rows = rows[layer] if layer < len(rows) else 0
        if layer_rows > 0 and size % layer_rows == 0:
            cols = size // layer_rows
            rank = min(layer_rows, cols, spec.rank)
            if should_compress(layer_rows, cols, rank, spec.min_rate):
                compressed.append((layer, start, layer_rows, cols))
                continue
        if vectors and sum(vectors[-1]) == start:  # adjacent: one copy
            vectors[-1] = (vectors[-1][0], vectors[-1][1] + size)
        else:
            vectors.append((start, size))
    vector_elements = sum(size for _, size in vectors)
    p_at, q_at = vector_elements, 0
    for layer, start, layer_rows, cols in compressed:
        rank = min(layer_rows, cols, spec.rank)
        matrices.append(MatrixLayer(layer, start, layer_rows, cols, rank, p_at, q_at))
        p_at += layer_rows * rank
        q_at += cols * rank
    return GroupForm(tuple(matrices), tuple(vectors), vector_elements, p_at, q_at)


def initial_q(seed: int, layer: int, iteration: int, cols: int, rank: int,
              epsilon: float) -> np.ndarray:
    """A fresh, orthogonalised Q for ``layer``: the same on every node (seeded by the job's
    seed, the layer and, without warm start, the iteration), float32."""
    generator = np.random.default_rng([seed, layer, iteration])
    q = generator.standard_normal((cols, rank), dtype=np.float32)
    orthogonalize(q, epsilon)
    return q


def orthogonalize(matrix: np.ndarray, epsilon: float = 0.0) -> None:
    """Orthonormal columns in place (Gram-Schmidt, as torch's hook for rank ≤ 2; a
    reduced QR above). A zero column stays zero where torch's would turn into NaNs (a layer
    no rank used this iteration, with epsilon 0)."""
    rank = matrix.shape[1]
    if rank > 2:
        q, r = np.linalg.qr(matrix)
        # QR's signs are arbitrary; Gram-Schmidt's diagonal is positive: the same basis
        signs = np.sign(np.diag(r)).astype(matrix.dtype)
        signs[signs == 0] = 1
        matrix[...] = q * signs
        return
    for i in range(rank):
        column = matrix[:, i]
        norm = float(np.linalg.norm(column)) + epsilon
        if norm > 0:
            column /= norm
        else:
            column[:] = 0
        if i + 1 < rank:
            rest = matrix[:, i + 1:]
            rest -= np.outer(column, column @ rest)
