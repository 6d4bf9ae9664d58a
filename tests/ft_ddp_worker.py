"""One rank of a training script on commd's DistributedDataParallel for the fault-tolerance
tests: a small model with BatchNorm (its buffers are broadcast before every training forward),
SGD with momentum 0.9, fixed seeds, started as torchrun starts a rank (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, COMMD_JOB, COMMD_COORDINATOR, COMMD_SOCKET, COMMD_TIMEOUT in
the environment; no torch process group).

The spec (JSON, the last argument):

- ``out``: the folder for ``rank<N>.pt``: ``{"state", "optimizer", "world_size", "members",
  "world_sizes", "steps", "step_seconds"}`` after training, or ``{"error", "error_type",
  "commd_error", "steps"}`` when training raised (then the script exits 1, as an uncaught
  exception would).
- ``steps``; ``fault_tolerance``: the wrapper's keyword, or None to leave it out (the
  default, "fail"); ``planner`` likewise (None: the daemon's choice, which may merge this
  small model into one group; "wfbp": a group per layer, each sent as soon as it is ready).
- ``kill_step`` and ``kill_when`` for the victim (only the rank given them): ``"backward"``
  exits (``os._exit(17)``) inside the backward of that step, from a hook on the middle
  layer's weight that runs after the wrapper's own hook on it (so the gradients of the layers
  after it are already handed to commd); ``"between"`` exits after the previous step's
  ``optimizer.step()``, before that step's forward.

After the last step one forward in eval mode (grad enabled, no backward) takes the buffer
broadcast's values without BatchNorm updating them with this rank's batch: every rank's
buffers are then the source's, comparable bit for bit.

Usage: python ft_ddp_worker.py '<json spec>'
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from commd_client import CommdError
from commd_client.torch import DistributedDataParallel

VICTIM_EXIT = 17
BATCH = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm1 = nn.BatchNorm1d(16)
        self.mid = nn.Linear(16, 16)
        self.norm2 = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm1(self.inp(x)))
        x = torch.relu(self.norm2(self.mid(x)))
        return self.head(x)


def save(out: Path, rank: int, record: dict[str, Any]) -> None:
    path = out / f"rank{rank}.pt"
    torch.save(record, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)


def main() -> int:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = Path(spec["out"])
    kill_step = spec.get("kill_step")
    kill_when = spec.get("kill_when")
    torch.manual_seed(7 + rank)  # different weights per rank: the wrapper broadcasts rank 0's
    model = Net()
    keywords = {name: spec[name] for name in ("fault_tolerance", "planner")
                if spec.get(name) is not None}
    ddp = DistributedDataParallel(model, **keywords)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    armed = [False]

    def die_in_backward(param: torch.Tensor) -> None:
        if armed[0]:
            os._exit(VICTIM_EXIT)

    # registered after the wrapper's hooks: on this weight the wrapper's runs first
    model.mid.weight.register_post_accumulate_grad_hook(die_in_backward)
    data = torch.Generator().manual_seed(100 + rank)
    world_sizes: list[int] = []
    step_seconds: list[float] = []  # for a failure's message: where the survivors paused
    step = 0
    try:
        for step in range(spec["steps"]):
            x = torch.randn(BATCH, 8, generator=data)
            y = torch.randn(BATCH, 4, generator=data)
            if step == kill_step and kill_when == "between":
                os._exit(VICTIM_EXIT)
            armed[0] = step == kill_step and kill_when == "backward"
            started = time.monotonic()
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            world_sizes.append(ddp.world_size)
            step_seconds.append(time.monotonic() - started)
        ddp.eval()
        ddp(torch.randn(BATCH, 8, generator=data))  # the buffers: the source's, untouched
    except CommdError as exc:
        save(out, rank, {"error": str(exc), "error_type": type(exc).__name__,
                         "commd_error": True, "steps": step})
        return 1
    except Exception as exc:
        save(out, rank, {"error": f"{type(exc).__name__}: {exc}",
                         "error_type": type(exc).__name__, "commd_error": False,
                         "steps": step})
        return 1
    save(out, rank, {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                     "optimizer": optimizer.state_dict(), "world_size": ddp.world_size,
                     "members": list(ddp.members), "world_sizes": world_sizes,
                     "steps": len(world_sizes), "step_seconds": step_seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
