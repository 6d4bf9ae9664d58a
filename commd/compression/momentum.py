"""The dense rounds of a momentum-corrected compressed job (see docs/design/compression.md,
"Momentum correction in the daemon"): the velocity carried on, and what top-k held back released
gradually. One chunked numpy pass, or one compiled loop where they are built (native.py)."""

from __future__ import annotations

import numpy as np

from commd.compression import native
from commd.compression.kernels import (
    CHUNK,
    accelerate,
    check_momentum,
    check_update,
    run_parts,
    zero,
)

__all__ = ["add_momentum", "release_held"]


def add_momentum(total: np.ndarray, residual: np.ndarray | None, velocity: np.ndarray,
                 momentum: float, release_all: bool = False) -> None:
    """A dense group of a momentum-corrected job: velocity = m·velocity + total, then
    total = velocity + (1 − m)·residual and residual = m·residual (m: ``momentum``).

    What top-k held back (accumulated velocity) reaches the sum over the next dense rounds at
    the rate momentum spreads a gradient, (1 − m)·m^j in round j, rather than as one lump:
    sent at once, a few rounds' held-back velocity is one outsized step (the loss jumped at
    every switch from compressed to dense rounds in our DDP runs). ``release_all``: the last
    such round, total = velocity + residual and residual = 0 (the caller's rule, before m^j
    reaches the subnormal floats, whose arithmetic is many times slower). ``residual`` None:
    it is known to be zero, total = velocity."""
    if residual is None:
        check_update(velocity, total, "total", "velocity")
    else:
        check_update(residual, total, "total")
        check_update(residual, velocity, "velocity")
    check_momentum(momentum)
    dtype = velocity.dtype.type
    keep, release = (dtype(0), dtype(1)) if release_all else (dtype(momentum),
                                                               dtype(1 - momentum))
    loops = native.active()
    if loops is not None and native.contiguous(total, residual, velocity):
        loops.momentum(total, residual, velocity, momentum, float(keep), float(release),
                       release_all, velocity.dtype == np.float64)
        return

    def work(_part: int, lo: int, hi: int) -> None:
        for start in range(lo, hi, CHUNK):
            stop = min(hi, start + CHUNK)
            chunk = total[start:stop]
            sped = accelerate(velocity[start:stop], chunk, momentum)
            if residual is None:
                np.copyto(chunk, sped)
                continue
            held = residual[start:stop]
            np.multiply(held, release, out=chunk)
            np.add(chunk, sped, out=chunk)
            if release_all:
                zero(held)
            else:
                np.multiply(held, keep, out=held)

    run_parts(velocity.size, work)


def release_held(total: np.ndarray, residual: np.ndarray, share: float,
                 release_all: bool = False) -> None:
    """A dense group of a compressed job without the daemon's momentum: total += share·residual
    and residual = (1 − share)·residual, so what top-k held back reaches the sum over the
    next dense rounds rather than as one lump (with the rank's momentum correction the lump
    is applied at the learning rate at once: the loss jumped at late switches to dense).
    ``release_all``: the last such round, total += residual and residual = 0."""
    check_update(residual, total, "total")
    dtype = residual.dtype.type
    keep, release = dtype(1 - share), dtype(share)

    def work(_part: int, lo: int, hi: int) -> None:
        for start in range(lo, hi, CHUNK):
            stop = min(hi, start + CHUNK)
            chunk, held = total[start:stop], residual[start:stop]
            if release_all:
                np.add(chunk, held, out=chunk)
                zero(held)
                continue
            chunk += held * release
            np.multiply(held, keep, out=held)

    run_parts(residual.size, work)
