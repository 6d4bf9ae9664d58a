"""One rank of a ``fault_tolerance="continue"`` DDP training run for the rejoin tests: a small
model with BatchNorm, SGD with momentum and a step counter registered with
``ddp.register_state``. Environment as torchrun sets it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE) plus COMMD_JOB, COMMD_COORDINATOR, COMMD_SOCKET.

Spec (JSON, last argument): ``steps``; ``die_at`` (this rank vanishes inside that step's
backward: after its first gradient hook, with the others' collectives under way);
``hold_at`` + ``joiner_rank`` (the others wait before that step until the daemon shows the
replacement in the job); ``hold_again_at`` + ``hold_again_epoch`` (the others wait before
that step until the replacement is in the job again, in that membership epoch or a later
one: a second start after the first failed); ``die_giving_state`` (this rank vanishes as it
starts giving a joiner the training state); ``progress_dir``. Prints one JSON line: the step
it started at, the world sizes it saw, and digests of its parameters, buffers and optimizer
state.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

from commd_client.torch import DistributedDataParallel as DDP


class Counter:
    """The loop's own state, as a user would register it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes()
                                   for t in tensors)).hexdigest()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def hold_until_joined(spec: dict[str, Any], epoch: int = 0) -> None:
    from commd.cli.status import query

    deadline = time.monotonic() + 60
    job = os.environ["COMMD_JOB"]
    while True:
        jobs = [j for j in query(os.environ["COMMD_SOCKET"])["jobs"] if j["job"] == job]
        if jobs and spec["joiner_rank"] in jobs[0]["members"] and jobs[0]["epoch"] >= epoch:
            return
        if time.monotonic() > deadline:
            raise SystemExit("the replacement never joined")
        time.sleep(0.02)  # polling a condition, with a deadline


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    if spec.get("die_giving_state"):  # this rank vanishes as it starts a hand-over
        import commd_client._torch_rejoin as rejoin

        def vanish(*args: Any, **kwargs: Any) -> None:
            os._exit(17)

        rejoin.send = vanish
    ddp = DDP(model, fault_tolerance="continue")
    # torch's first optimizer loads this lazily; a joiner must have loaded it before joining
    preloaded = "torch._dynamo" in sys.modules
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    counter = Counter()
    ddp.register_state("optimizer", optimizer)
    ddp.register_state("counter", counter)
    out: dict[str, Any] = {"rank": rank, "joined_at": ddp.joined_at_step,
                           "counter_at_join": counter.step, "world_sizes": [],
                           "preloaded": preloaded}
    for step in range(ddp.joined_at_step, spec["steps"]):
        if step == spec.get("hold_at") and rank != spec.get("joiner_rank"):
            hold_until_joined(spec)
        if step == spec.get("hold_again_at") and rank != spec.get("joiner_rank"):
            hold_until_joined(spec, spec["hold_again_epoch"])
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(ddp(x), y)
        if step == spec.get("die_at"):
            model[3].weight.register_hook(lambda grad: os._exit(17))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        counter.step += 1
        out["world_sizes"].append(ddp.world_size)
    # Buffers are broadcast before each forward, and training forwards then update them
    # with each rank's own batch: one eval forward leaves them as broadcast.
    model.eval()
    ddp(batch(rank, spec["steps"])[0])
    state = optimizer.state_dict()["state"]
    out["params"] = digest(list(model.parameters()))
    out["buffers"] = digest([b for b in model.buffers() if b.dtype.is_floating_point])
    out["momentum"] = digest([state[i]["momentum_buffer"] for i in sorted(state)])
    out["counter"] = counter.step
    out["members"] = ddp.members
    print(json.dumps(out), flush=True)
    ddp.close()


if __name__ == "__main__":
    main()
