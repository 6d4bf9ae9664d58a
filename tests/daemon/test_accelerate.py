"""``commd_client.accelerate.Accelerator`` against stock ``accelerate.Accelerator``.

``tests/accelerate_worker.py`` is an Accelerate script (BatchNorm, a prepared DataLoader, SGD
with momentum, StepLR) in phases — ``accumulate`` with ``gradient_accumulation_steps=2`` and
``clip_grad_norm_``; ``no_sync`` then ``trigger_sync_in_backward``; ``save_state``, an epoch,
``load_state``, the same epoch again — whose only difference between the two runs is the
import. 2 ranks on CPU (``DistributedType.MULTI_CPU``, Gloo), real ``commd run`` daemons.

- ``test_matches_stock``: launched with torchrun's environment on one daemon and on two (one
  rank each), and by ``accelerate launch`` (with a config file, never the user's) with
  ``DistributedDataParallelKwargs(broadcast_buffers=False, bucket_cap_mb=1,
  gradient_as_bucket_view=True, comm_hook=FP16)``: the prepared model is commd's wrapper
  with the hook and buffer setting torch's reports, ``unwrap_model`` gives back the module
  passed to ``prepare``, and after every phase the parameters and
  buffers on every rank equal stock accelerate's (torch DDP) on the same seeds to 1e-5, as do
  the clip norms; ``load_state`` restores rank 0's saved state and the resumed epoch ends where
  the first one did.
- ``test_single_process_is_stock``: without distribution nothing is wrapped and no daemon is
  needed (its socket does not exist); the results equal stock's exactly.
- ``test_bad_compression_fails_every_rank``: a compression the daemon does not understand is a
  ``CommdError`` naming it on both ranks, not a hang.
- ``test_warns_when_launched_but_not_distributed``: 2 ranks without ``cpu=True`` on a machine
  without GPUs (accelerate then trains each rank alone, stock too): each logs a warning.
- ``test_refused_*``: bad commd keywords, bad ``DistributedDataParallelKwargs`` values,
  PowerSGD hooks and FSDP are refused before anything starts, naming what was wrong.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate.utils import (  # after the skip
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
)

from commd.testing.daemons import LocalDaemon, gloo_daemons
from commd.testing.ports import free_port
from commd.testing.processes import run_launchers, run_stock_launchers, torchrun_env
from commd_client.accelerate import Accelerator
from commd_protocol import CommdError, CommdTypeError, CommdValueError

WORKER = Path(__file__).parents[1] / "accelerate_worker.py"
WORLD_SIZE = 2
RUN_TIMEOUT_S = 90.0  # a run takes a few seconds; a hang until the client timeout takes 120
COMMD_DDP = "commd_client.torch.DistributedDataParallel"
PHASES = ("accumulate", "no_sync", "after_save", "loaded", "resumed")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "COMMD_JOB",
                  "COMMD_SOCKET", "COMMD_COORDINATOR", "COMMD_TIMEOUT", "COMMD_COMPRESSION",
                  "COMMD_PLANNER", "ACC_IMPL", "ACCELERATE_USE_CPU", "ACCELERATE_CONFIG_FILE")
# `accelerate launch` starts several local processes only for the GPU types (the CPU type runs
# them through MPI); the script's Accelerator(cpu=True) makes each one MULTI_CPU on Gloo.
LAUNCH_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
gpu_ids: all
rdzv_backend: static
same_network: true
debug: false
"""

pytestmark = pytest.mark.timeout(int(4 * RUN_TIMEOUT_S) + 60)


@dataclass
class Run:
    records: list[dict[str, Any] | None]
    problem: str  # "" when every process exited 0 in time
    log: str


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalDaemon]]:
    """Two real `commd run` daemons on 127.0.0.1, stopped after the last test."""
    with gloo_daemons(tmp_path_factory.mktemp("accelerate-daemons")) as started:
        yield started


def run_worker(impl: str, launch: str, daemons: int, nodes: list[LocalDaemon], out: Path,
               *extra: str) -> Run:
    """One run of the worker: ``single`` (one plain process), ``env`` (one process per rank
    with torchrun's environment; with two daemons rank r on daemon r) or ``accelerate``
    (``accelerate launch``, both ranks on daemon 0)."""
    out.mkdir(parents=True)
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    # HF_HOME in the run's folder: accelerate reads and writes no config of the user's
    base.update(ACC_IMPL=impl, HF_HOME=str(out / "hf"), COMMD_TIMEOUT="120",
                COMMD_COORDINATOR=nodes[0].address, COMMD_SOCKET=nodes[0].socket)
    port = free_port()
    script = [str(WORKER), "--out", str(out), *extra]
    if launch == "single":
        commands = [[sys.executable, *script]]
        envs = [{**base, "COMMD_SOCKET": str(out / "no-daemon-here.sock")}]
    elif launch == "accelerate":
        config = out / "accelerate.yaml"
        config.write_text(LAUNCH_CONFIG)
        commands = [[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                     str(config), "--main_process_port", str(port), *script]]
        envs = [base]
    else:
        commands, envs = [], []
        for rank in range(WORLD_SIZE):
            node, local_rank, local_world = (rank, 0, 1) if daemons == 2 else (0, rank, 2)
            commands.append([sys.executable, *script])
            envs.append(torchrun_env(base, rank=rank, world_size=WORLD_SIZE,
                                     local_rank=local_rank, local_world_size=local_world,
                                     master_port=port, socket=nodes[node].socket))
    log_path = out / "run.log"
    log_path.write_bytes(b"")
    launch_all = run_launchers if impl == "commd" else run_stock_launchers
    problem = launch_all(commands, envs, [log_path] * len(commands), RUN_TIMEOUT_S)
    ranks = 1 if launch == "single" else WORLD_SIZE
    records = [torch.load(path) if (path := out / f"rank{rank}.pt").exists() else None
               for rank in range(ranks)]
    return Run(records, problem, log_path.read_text(errors="replace")[-4000:])


@pytest.fixture(scope="module")
def stock(nodes: list[LocalDaemon], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, Run]]:
    """Stock accelerate's runs (torch DDP), one per DDP-kwargs variant, made when first asked
    for; torch DDP's results do not depend on how the ranks were launched."""
    runs: dict[str, Run] = {}

    class Lazy(dict[str, Run]):
        def __missing__(self, variant: str) -> Run:
            out = tmp_path_factory.mktemp(f"stock-{variant}")
            run = run_worker("stock", "env", 1, nodes, out / "run", "--variant", variant)
            assert not run.problem, f"stock accelerate failed: {run.problem}\n{run.log}"
            self[variant] = run
            return run

    yield Lazy(runs)


def assert_states_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        where: str) -> None:
    assert set(got) == set(want), where
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5,
                                   msg=lambda m, k=key: f"{where} {k}: {m}")


CONFIGS = [("env", 1, "default"), ("env", 2, "default"), ("accelerate", 1, "custom")]


@pytest.mark.parametrize(("launch", "daemons", "variant"), CONFIGS,
                         ids=[f"{launch}-{n}daemon-{v}" for launch, n, v in CONFIGS])
def test_matches_stock(launch: str, daemons: int, variant: str, nodes: list[LocalDaemon],
                       stock: dict[str, Run], tmp_path: Path) -> None:
    want = stock[variant]
    run = run_worker("commd", launch, daemons, nodes, tmp_path / "commd", "--variant", variant)
    assert not run.problem, f"commd: {run.problem}\n{run.log}"
    for rank in range(WORLD_SIZE):
        got, ref = run.records[rank], want.records[rank]
        assert got is not None and ref is not None, run.log
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["ddp_class"] == COMMD_DDP
        assert ref["ddp_class"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        assert got["unwrapped_is_raw"] and ref["unwrapped_is_raw"]
        assert got["raw_marked"] == ref["raw_marked"]
        assert (got["world_size"], got["distributed_type"]) == (2, "DistributedType.MULTI_CPU")
        # the comm hook and buffer broadcast as asked (no hook: torch logs no key, commd "")
        assert (got["logged"]["comm_hook"] or None) == ref["logged"]["comm_hook"]
        assert got["logged"]["broadcast_buffers"] == ref["logged"]["broadcast_buffers"]
        torch.testing.assert_close(got["norms"], ref["norms"], rtol=0, atol=1e-5)
        for phase in PHASES:
            assert_states_equal(got["states"][phase], ref["states"][phase],
                                f"rank {rank} after {phase}:")
        # load_state brought back what rank 0 saved; the epoch after it ends as before
        assert_states_equal(got["states"]["loaded"], run.records[0]["states"]["no_sync"],
                            f"rank {rank} loaded:")
    first, second = (record["states"]["resumed"] for record in run.records if record)
    for key in ("body.weight", "norm.weight", "head.bias"):
        assert torch.equal(first[key], second[key]), key
    assert_states_equal(run.records[0]["states"]["resumed"],
                        run.records[0]["states"]["after_save"], "rank 0 resumed:")
    if variant == "custom":
        # broadcast_buffers=False was honoured: rank 1 kept statistics of its own, which the
        # default variant's broadcasts overwrite (so the comparison above could tell)
        own = run.records[1]["states"]["no_sync"]["norm.running_mean"]
        broadcast = stock["default"].records[1]["states"]["no_sync"]["norm.running_mean"]
        assert not torch.allclose(own, broadcast, atol=1e-3)


def test_single_process_is_stock(nodes: list[LocalDaemon], tmp_path: Path) -> None:
    runs = {impl: run_worker(impl, "single", 0, nodes, tmp_path / impl)
            for impl in ("stock", "commd")}
    for impl, run in runs.items():
        assert not run.problem, f"{impl}: {run.problem}\n{run.log}"
    want, got = runs["stock"].records[0], runs["commd"].records[0]
    assert want is not None and got is not None
    assert got["ddp_class"] == "__main__.Net"  # not wrapped: nothing to reduce
    assert (got["world_size"], got["distributed_type"]) == (1, "DistributedType.NO")
    assert got["norms"] == want["norms"]
    for phase in PHASES:
        for key, value in want["states"][phase].items():
            assert torch.equal(got["states"][phase][key], value), (phase, key)


def test_bad_compression_fails_every_rank(nodes: list[LocalDaemon], tmp_path: Path) -> None:
    run = run_worker("commd", "env", 1, nodes, tmp_path / "commd", "--compression", "topk:lots")
    assert "hung" not in run.problem, f"the run waited for the timeout:\n{run.log}"
    for rank, record in enumerate(run.records):
        assert record is not None and "error" in record, f"rank {rank}:\n{run.log}"
        assert "CommdError" in record["error"], record
        assert "compression 'topk:lots' is not understood" in record["error"], record


@pytest.mark.parametrize(("keywords", "error", "words"), [
    ({"compression": 0.01}, CommdTypeError, "compression=0.01"),
    ({"planner": ["optimal"]}, CommdTypeError, "planner="),
    ({"socket": Path("/run/commd/commd.sock")}, CommdTypeError, "socket="),
    ({"commd_timeout": -5}, CommdValueError, "commd_timeout=-5"),
    ({"commd_timeout": "soon"}, CommdValueError, "commd_timeout='soon'"),
], ids=["compression", "planner", "socket", "negative-timeout", "text-timeout"])
def test_refused_commd_keywords(keywords: dict[str, Any], error: type[Exception],
                                words: str) -> None:
    with pytest.raises(error, match="commd") as caught:
        Accelerator(cpu=True, **keywords)
    assert words in str(caught.value)


def test_refused_unknown_keyword() -> None:
    with pytest.raises(TypeError, match="compresion"):  # a misspelt keyword
        Accelerator(cpu=True, compresion="topk:auto")


@pytest.mark.parametrize(("fields", "error", "words"), [
    ({"bucket_cap_mb": 0}, CommdValueError, "bucket_cap_mb=0"),
    ({"bucket_cap_mb": "25"}, CommdTypeError, "bucket_cap_mb='25'"),
    ({"broadcast_buffers": "no"}, CommdTypeError, "broadcast_buffers='no'"),
    ({"find_unused_parameters": 1}, CommdTypeError, "find_unused_parameters=1"),
    ({"dim": 0.5}, CommdTypeError, "dim=0.5"),
    ({"comm_hook": DDPCommunicationHookType.POWER_SGD}, CommdValueError, "powersgd"),
    ({"comm_hook": DDPCommunicationHookType.BATCHED_POWER_SGD}, CommdValueError, "power_sgd"),
    ({"comm_hook": DDPCommunicationHookType.FP16,
      "comm_wrapper": DDPCommunicationHookType.BF16}, CommdValueError, "comm_wrapper=bf16"),
], ids=["cap-zero", "cap-text", "broadcast-text", "unused-int", "dim-float", "powersgd",
        "batched-powersgd", "wrapper"])
def test_refused_ddp_kwargs(fields: dict[str, Any], error: type[Exception], words: str) -> None:
    handler = DistributedDataParallelKwargs(**fields)
    with pytest.raises(error, match="DistributedDataParallelKwargs") as caught:
        Accelerator(cpu=True, kwargs_handlers=[handler])
    assert words in str(caught.value)


def test_warns_when_launched_but_not_distributed(nodes: list[LocalDaemon],
                                                tmp_path: Path) -> None:
    """Two ranks launched without cpu=True on a machine without GPUs: accelerate (stock too)
    trains every rank alone; commd's Accelerator says so."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU accelerate picks MULTI_GPU (refused) instead")
    run = run_worker("commd", "env", 1, nodes, tmp_path / "commd", "--construct-only")
    assert not run.problem, f"{run.problem}\n{run.log}"
    assert run.log.count("WORLD_SIZE=2, but accelerate runs without distribution") == 2, run.log
    assert "Accelerator(cpu=True)" in run.log


def test_refused_fsdp() -> None:
    with pytest.raises(CommdError, match=r"fsdp_plugin=.*not supported"):
        Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
