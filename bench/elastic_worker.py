"""One rank of bench/elastic.py: a small MLP on synthetic data, trained step by step under one
of three systems, every completed step appended to a progress file as it happens.

- ``commd``: commd's DistributedDataParallel (fault tolerance from COMMD_FAULT_TOLERANCE, so
  the script is the one-line port), one plain process per node;
- ``torch``: stock torch DDP over Gloo under torchrun (RANK, WORLD_SIZE, MASTER_ADDR from it),
  a checkpoint every ``checkpoint_every`` steps written by rank 0, loaded after a restart;
- ``torchft``: torchft's Manager, DDP and Gloo process group, one replica group of one rank
  per process, against the bench's Lighthouse.

Progress lines are ``step monotonic_s wall_s committed`` (CLOCK_MONOTONIC is one clock for every
process of the machine, so the bench can line them up with the moment it struck; the wall time
lines them up with the daemons' logs). ``committed`` is 0 for a step whose update was thrown
away (torchft's should_commit said no). A restarted torchrun rank appends to the same file.
At the end each rank writes ``rank<R>.json``: its parameters' digest and what it saw.
A rank whose spec has ``pause_giving_state`` stops as it starts handing its state to a joiner
(commd) or a healing replica (torchft), the file ``donor`` says so, for the bench to kill it
there.

Usage: python elastic_worker.py SYSTEM '<json spec>'   (torchrun runs it the same way)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from commd.testing.processes import await_file

INPUTS, WIDTH, CLASSES = 256, 512, 10


def build_model(seed: int) -> nn.Module:
    """The same initial parameters on every rank (torch's DDP would broadcast them anyway)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(INPUTS, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.ReLU(), nn.Linear(WIDTH, CLASSES))


def batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: a pure function of both, so a redone step sees
    the same data it saw the first time."""
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    inputs = torch.randn(size, INPUTS, generator=generator)
    return inputs, torch.randint(0, CLASSES, (size,), generator=generator)


def digest(model: nn.Module) -> str:
    hasher = hashlib.sha256()
    for parameter in model.parameters():
        hasher.update(parameter.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


class Progress:
    """The rank's progress file, one flushed line per completed step."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = Path(directory)
        (self.directory / f"rank{rank}.pid").write_text(str(os.getpid()))
        self._file: TextIO = open(self.directory / f"rank{rank}.log", "a")  # noqa: SIM115
        self.rank = rank

    def step(self, step: int, committed: bool = True) -> None:
        self._file.write(f"{step} {time.monotonic():.6f} {time.time():.6f} {int(committed)}\n")
        self._file.flush()

    def finish(self, model: nn.Module, **seen: Any) -> None:
        self._file.close()
        result = {"rank": self.rank, "digest": digest(model), **seen}
        (self.directory / f"rank{self.rank}.json").write_text(json.dumps(result))


class Victim:
    """The rank the fault strikes: in step ``at`` it stops inside its backward pass (the others
    are then in, or on their way to, that step's all-reduce, which cannot finish without it),
    says so with the file ``struck`` and waits there for the bench's signal. Only once: a
    restarted rank (torchrun) finds the file and trains on."""

    def __init__(self, module: nn.Module, directory: str, at: int) -> None:
        self.marker = Path(directory) / "struck"
        self.at = at
        self.step = -1
        # the first layer's gradient is the last one backward computes
        first = next(module.parameters())
        first.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self.step == self.at and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            signal.pause()  # until the bench's SIGKILL (or its SIGSTOPped daemon's end)
        return grad


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int,
               size: int, victim: Victim | None) -> None:
    if victim is not None:
        victim.step = step
    inputs, targets = batch(rank, step, size)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), targets).backward()


def victim_of(spec: dict[str, Any], rank: int, module: nn.Module) -> Victim | None:
    if rank != spec["victim"]:
        return None
    return Victim(module, spec["progress_dir"], spec["kill_at"])


def await_go(spec: dict[str, Any]) -> None:
    """A replacement is started early (imports are slow on a busy machine): it says it is
    ready (``go.ready``) and joins when the bench says so (the file ``go``; the spec may name
    another, for a second replacement). Any other rank goes on at once."""
    if not spec.get("joiner"):
        return
    go = Path(spec["progress_dir"]) / spec.get("go", "go")
    go.with_suffix(".ready").touch()
    await_file(go, spec["timeout"])


def paused_giving_state(send: Callable[..., None], directory: Path,
                        when: Callable[[], bool] = lambda: True) -> Callable[..., None]:
    """``send`` (what hands a joiner the training state), stopping first, the first time
    and ``when`` says so: the rank says where it stopped (the file ``donor``, with its pid)
    and waits there for the bench's SIGKILL — a kill during a join, at a known moment."""
    marker = directory / "donor"

    def paused(*args: Any, **kwargs: Any) -> None:
        if when() and not marker.exists():
            marker.write_text(str(os.getpid()))
            while True:
                time.sleep(3600)  # until the bench's SIGKILL (on whichever thread this runs)
        send(*args, **kwargs)

    return paused


def run_commd(spec: dict[str, Any]) -> None:
    from commd_client import CommdError
    from commd_client.torch import DistributedDataParallel

    rank = spec["rank"]
    directory = Path(spec["progress_dir"])
    if spec.get("pause_giving_state"):
        import commd_client._torch_rejoin as rejoin

        rejoin.send = paused_giving_state(rejoin.send, directory)
    await_go(spec)
    progress = Progress(spec["progress_dir"], rank)
    module = build_model(spec["seed"])
    victim = None if spec.get("joiner") else victim_of(spec, rank, module)
    started = time.monotonic()
    try:
        model = DistributedDataParallel(module, job=spec["job"], rank=rank,
                                        world_size=spec["world_size"], local_rank=0,
                                        local_world_size=1, coordinator=spec["coordinator"],
                                        socket=spec["socket"], timeout=spec["timeout"])
    except CommdError:
        # when it failed, before the interpreter's exit (seconds with torch loaded)
        (directory / f"rank{rank}.failed").write_text(f"{time.monotonic():.6f}")
        raise
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    # every rank: a replacement takes the momentum from a live peer with the parameters
    model.register_state("optimizer", optimizer)
    returned = time.monotonic()
    for step in range(model.joined_at_step, spec["steps"]):
        train_step(model, optimizer, rank, step, spec["batch"], victim)
        optimizer.step()
        progress.step(step)
    progress.finish(module, world_size=model.world_size, members=list(model.members),
                    joined_at_step=model.joined_at_step, ddp_started=started,
                    ddp_returned=returned)
    model.close()


def run_torch(spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = Progress(spec["progress_dir"], rank)
    module = build_model(spec["seed"])
    victim = victim_of(spec, rank, module)
    model = TorchDDP(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    checkpoint = Path(spec["progress_dir"]) / "checkpoint.pt"
    start = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["steps"]
    for step in range(start, spec["steps"]):
        train_step(model, optimizer, rank, step, spec["batch"], victim)
        optimizer.step()
        progress.step(step)
        if rank == 0 and (step + 1) % spec["checkpoint_every"] == 0:
            # written aside and renamed: a kill during the write leaves the previous one whole
            partial = checkpoint.with_suffix(".partial")
            torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                        "steps": step + 1}, partial)
            partial.replace(checkpoint)
    progress.finish(module, world_size=dist.get_world_size(), started_at=start,
                    restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    dist.destroy_process_group()


def tolerant_hook(fallbacks: list[int]) -> Callable[[Any, Any], torch.futures.Future[Any]]:
    """torchft 0.2.0's DDP comm hook with one change: when the all-reduce failed (a peer died
    inside it) it returns the local buffer instead of failing ``assert fut._fut``; the manager
    has latched the error, so should_commit() throws this step's update away. Each such
    fallback appends its step to ``fallbacks``."""

    def hook(manager: Any, bucket: Any) -> torch.futures.Future[Any]:
        work = manager.allreduce(bucket.buffer())
        work.wait()
        inner = getattr(work.get_future(), "_fut", None)
        if inner is not None:
            return inner  # type: ignore[no-any-return]
        fallbacks.append(manager.current_step())
        local: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        local.set_result(bucket.buffer())
        return local

    # torch's check of a comm hook compares the annotations with dist.GradBucket itself; this
    # module's are strings (postponed evaluation), so the hook goes without them
    hook.__annotations__ = {}
    return hook


def run_torchft(spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel as FtDDP

    fallbacks: list[int] = []

    class TolerantDDP(FtDDP):
        _comm_hook = staticmethod(tolerant_hook(fallbacks))

    rank = spec["rank"]
    await_go(spec)
    progress = Progress(spec["progress_dir"], rank)
    module = build_model(spec["seed"])
    victim = None if spec.get("joiner") else victim_of(spec, rank, module)
    optimizer = torch.optim.SGD(module.parameters(), lr=spec["lr"], momentum=0.9)
    # each replica group (one rank) has its own store, as torchft's examples start one per group
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=True,
                          wait_for_workers=False)

    def load(state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    timeout = timedelta(seconds=spec["torchft_timeout"])
    started = time.monotonic()
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2,
                      load_state_dict=load,
                      state_dict=lambda: {"model": module.state_dict(),
                                          "optimizer": optimizer.state_dict()},
                      replica_id=f"replica{rank}" + ("-replacement" if spec.get("joiner") else ""),
                      lighthouse_addr=spec["lighthouse"],
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    if spec.get("pause_giving_state"):  # stop as it starts sending a healing peer the state
        transport = manager._checkpoint_transport
        # not at the first step's weight sync (init_sync): at a replacement's heal
        transport.send_checkpoint = paused_giving_state(  # type: ignore[method-assign]
            transport.send_checkpoint, Path(spec["progress_dir"]),
            lambda: manager.current_step() > spec["kill_at"])
    model = TolerantDDP(manager, module) if spec["hook"] == "tolerant" else FtDDP(manager, module)
    # All three replicas heartbeat before any asks for the first quorum: a replica that asks
    # late waits outside the quorum until its membership changes, and the fault would then
    # strike a job of two
    barrier(Path(spec["progress_dir"]), rank, spec["world_size"], spec["timeout"])
    discarded = 0
    first: tuple[int, float] | None = None  # its first committed step, and when: a replacement
    while manager.current_step() < spec["steps"]:
        manager.start_quorum()
        train_step(model, optimizer, rank, manager.current_step(), spec["batch"], victim)
        committed = manager.should_commit()
        # the step as the quorum left it (a replica that healed took the job's), before the
        # commit counted it
        step = manager.current_step() - 1 if committed else manager.current_step()
        if committed:
            optimizer.step()
            first = first or (step, time.monotonic())
        else:
            discarded += 1
        progress.step(step, committed)
    # a replacement heals inside its first quorum: its start to that step is its join
    joined_at, returned = first or (spec["steps"], time.monotonic())
    progress.finish(module, discarded=discarded, local_buffer_returned_at=fallbacks,
                    joined_at_step=joined_at, ddp_started=started, ddp_returned=returned)
    manager.shutdown(wait=False)


def barrier(directory: Path, rank: int, world_size: int, timeout: float) -> None:
    """Until every rank has reached this point (a file each), or fail after ``timeout``."""
    (directory / f"ready{rank}").touch()
    for other in range(world_size):
        await_file(directory / f"ready{other}", timeout)


SYSTEMS = {"commd": run_commd, "torch": run_torch, "torchft": run_torchft}


def main() -> None:
    system, spec = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(spec["threads"])
    SYSTEMS[system](spec)


if __name__ == "__main__":
    main()
