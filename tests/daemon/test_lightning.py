"""PyTorch Lightning's ``strategy="commd"`` / ``CommdDDPStrategy`` against ``strategy="ddp"``
(issue 35, item 3).

``tests/lightning_worker.py`` trains a BatchNorm regressor (automatic optimisation,
``accumulate_grad_batches=2``, ``gradient_clip_val``; checkpoint, resume with ``ckpt_path=``,
``trainer.test``) and a GAN-ish toy (manual optimisation, two optimizers toggled) on two CPU
ranks, Gloo, real commd daemons; each run goes once under Lightning's ``strategy="ddp"`` and
once under commd's, from the same seeds. Two launches, one run per strategy each:

- ``lightning``: the script is started once and Lightning's own launcher (popen, as for
  ``strategy="ddp"``) starts rank 1; one daemon; the strategy given by its registered name,
  ``strategy="commd"``.
- ``torchrun``: one process per rank with torchrun's environment, two nodes, one daemon
  each; ``CommdDDPStrategy(...)``; last, a compression the daemon refuses.

Tests:

- ``test_matches_ddp[launch]``: per rank, parameters and buffers (BatchNorm statistics
  included) after the first epoch, after the resumed second epoch and after the manual phase
  equal ``"ddp"``'s to 1e-5 (after the manual phase the ranks' generator statistics differ,
  in both: buffers are not broadcast while Lightning turns sync off); the same global steps
  and test loss; every fit was wrapped by commd's ``DistributedDataParallel`` and the
  strategy's teardown closed it.
- ``test_spawn_matches_ddp_spawn``: ``strategy="commd_spawn"`` (Lightning's spawn launcher)
  against ``"ddp_spawn"``: rank 0's model, handed back to the launching process, to 1e-5.
- ``test_fp16_hook_is_registered_on_the_cpu``: ``ddp_comm_hook=fp16_compress_hook`` reaches
  commd's wrapper (Lightning's ``"ddp"`` drops hooks on the CPU); the ranks agree.
- ``test_bad_compression_is_refused_by_name``: ``compression="topk:lots"`` ends ``fit`` on
  both ranks with a CommdError naming the compression.
- ``test_daemons_serve_after_teardown``: after all runs the daemons still answer ``commd
  status``, hold no job and no connected rank, and /dev/shm has no new commd segment.
- ``test_registered_name``: after ``import commd_client.lightning``, ``strategy="commd"``
  builds a ``CommdDDPStrategy`` (popen launch, as ``"ddp"``), ``"commd_spawn"`` one that
  spawns; ``"ddp"`` stays Lightning's.
- ``test_bad_options_are_refused``: unknown keywords, wrongly typed or valued options, hooks
  and features commd cannot run: TypeError / ValueError / CommdError naming what was wrong,
  at construction; a CUDA device before the process group forms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from rank_records import launch_for_records
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from commd.testing.daemons import LocalDaemon, commd_segments, gloo_daemons
from commd.testing.ports import free_port
from commd_client import CommdError

SCRIPT = Path(__file__).parents[1] / "lightning_worker.py"
WORLD_SIZE = 2
RUN_TIMEOUT_S = 90.0  # a run takes ~10 s on two busy cores; a hang ends as a failure
COMMD_DDP = "commd_client.torch.DistributedDataParallel"
TORCH_DDP = "torch.nn.parallel.distributed.DistributedDataParallel"
PHASES = ("auto_epoch1", "auto_epoch2", "manual")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "COMMD_JOB", "COMMD_SOCKET", "COMMD_COORDINATOR", "COMMD_TIMEOUT",
                  "PL_GLOBAL_SEED")

pytestmark = pytest.mark.timeout(int(4 * RUN_TIMEOUT_S) + 60)

Records = dict[tuple[str, str], list[dict[str, Any]]]


def run_worker(launch: str, strategy: str, phases: str, nodes: list[LocalDaemon],
               out: Path, ranks: int = WORLD_SIZE) -> list[dict[str, Any]]:
    """One run of the worker; each rank's record (a failed run fails the test here)."""
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    base.update(COMMD_TIMEOUT="60", COMMD_COORDINATOR=nodes[0].address)
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--launch", launch,
               "--phases", phases, "--out", str(out)]
    if launch != "torchrun":  # Lightning starts the ranks itself, on the same daemon
        commands, envs = [command], [{**base, "COMMD_SOCKET": nodes[0].socket}]
    else:  # torchrun's environment: two nodes of one rank, one daemon each
        port = free_port()
        commands = [command] * WORLD_SIZE
        envs = [{**base, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"lightning-{port}",
                 "COMMD_SOCKET": nodes[rank].socket} for rank in range(WORLD_SIZE)]
    return launch_for_records(f"{launch}/{strategy}", commands, envs, out / "run.log",
                              RUN_TIMEOUT_S, out, ranks, stock=not strategy.startswith("commd"))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalDaemon]]:
    """Two real `commd run` daemons on 127.0.0.1, stopped after the last test."""
    with gloo_daemons(tmp_path_factory.mktemp("lightning-daemons")) as started:
        yield started


@pytest.fixture(scope="module")
def segments_before() -> set[str]:
    return commd_segments()


@pytest.fixture(scope="module")
def records(nodes: list[LocalDaemon], segments_before: set[str],
            tmp_path_factory: pytest.TempPathFactory) -> Records:
    """Every run once: (launch, strategy) -> each rank's record."""
    out = tmp_path_factory.mktemp("lightning-runs")
    runs = [("lightning", "ddp", "auto,manual"), ("lightning", "commd", "auto,manual"),
            ("torchrun", "ddp", "auto,manual"), ("torchrun", "class", "auto,manual,hook,bad")]
    return {(launch, strategy): run_worker(launch, strategy, phases, nodes,
                                           out / f"{launch}-{strategy}")
            for launch, strategy, phases in runs}


@pytest.mark.parametrize(("launch", "commd"), [("lightning", "commd"), ("torchrun", "class")])
def test_matches_ddp(launch: str, commd: str, records: Records) -> None:
    for rank in range(WORLD_SIZE):
        want, got = records[(launch, "ddp")][rank], records[(launch, commd)][rank]
        assert got["rank"] == want["rank"] == rank
        assert got["strategy_class"] == "CommdDDPStrategy"
        assert want["strategy_class"] == "DDPStrategy"
        # one wrapper per fit (epoch 1, resumed epoch 2, manual), each closed at teardown
        assert got["wrappers_after_fit"] == [(COMMD_DDP, True)]
        assert got["wrappers_after_manual"] == [(COMMD_DDP, True)] * 3
        assert [name for name, _ in want["wrappers"]] == [TORCH_DDP] * 3
        assert got["global_step"] == want["global_step"] == 8  # 2 epochs of 4 optimizer steps
        assert got["manual_steps"] == want["manual_steps"] > 0
        assert got["test_loss"] == pytest.approx(want["test_loss"], abs=1e-5)
        for phase in PHASES:
            assert set(got[phase]) == set(want[phase]), phase
            for key, value in want[phase].items():
                torch.testing.assert_close(
                    got[phase][key].double(), value.double(), rtol=0, atol=1e-5,
                    msg=lambda m, p=phase, k=key, r=rank: f"rank {r} {p} {k}: {m}")  # type: ignore[misc]
        # manual optimisation turns buffer broadcasting off (as torch does): the ranks'
        # generator statistics differ, so matching per rank is matching torch's rule
        if rank == 1:
            first = records[(launch, commd)][0]["manual"]["generator.1.running_mean"]
            assert not torch.allclose(got["manual"]["generator.1.running_mean"], first)
        # the resumed fit started from the checkpoint, not from its own (other) init
        assert not torch.equal(got["auto_epoch2"]["net.0.weight"],
                               got["auto_epoch1"]["net.0.weight"])


def test_spawn_matches_ddp_spawn(nodes: list[LocalDaemon],
                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """``strategy="commd_spawn"`` against ``"ddp_spawn"``: rank 0's model, handed back to the
    launching process, equal to 1e-5."""
    out = tmp_path_factory.mktemp("lightning-spawn")
    (want,), (got,) = (run_worker("spawn", strategy, "spawned", nodes, out / strategy, ranks=1)
                       for strategy in ("ddp_spawn", "commd_spawn"))
    assert got["strategy_class"] == "CommdDDPStrategy"
    assert set(got["spawned"]) == set(want["spawned"])
    for key, value in want["spawned"].items():
        torch.testing.assert_close(got["spawned"][key].double(), value.double(), rtol=0,
                                   atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")  # type: ignore[misc]


def test_fp16_hook_is_registered_on_the_cpu(records: Records) -> None:
    """Lightning's own strategy registers hooks on CUDA only; commd runs fp16 on the CPU."""
    first, second = records[("torchrun", "class")]
    assert first["hook_logged"] == second["hook_logged"] == "fp16_compress_hook"
    for key, value in first["hook_trained"].items():
        if "running" not in key and "num_batches" not in key:  # buffers differ per rank
            assert torch.equal(value, second["hook_trained"][key]), key


def test_bad_compression_is_refused_by_name(records: Records) -> None:
    for record in records[("torchrun", "class")]:
        assert "CommdError" in record["bad_error"], record
        assert "compression 'topk:lots'" in record["bad_error"], record
        assert record["wrappers_after_bad"][-1] == (COMMD_DDP, True)  # closed despite it


def test_daemons_serve_after_teardown(records: Records, nodes: list[LocalDaemon],
                                      segments_before: set[str]) -> None:
    for node in nodes:
        assert node.process.poll() is None, node.log()
        reply = subprocess.run(
            [sys.executable, "-m", "commd.cli", "status", "--socket", node.socket, "--json",
             "--timeout", "20"], capture_output=True, text=True, timeout=60, check=True)
        status = json.loads(reply.stdout)
        assert status["jobs"] == [], status["jobs"]
        held = {share["kind"]: share["held"] for share in status["shares"]}
        assert held["ranks connected"] == 0 and held["jobs"] == 0, held
    assert commd_segments() <= segments_before


def test_registered_name() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    from commd_client.lightning import CommdDDPStrategy

    registered: Any = StrategyRegistry["commd"]["strategy"]
    assert registered is CommdDDPStrategy
    trainer = pl.Trainer(strategy="commd", accelerator="cpu", devices=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    made: Any = trainer.strategy
    assert isinstance(made, CommdDDPStrategy) and made._start_method == "popen"
    spawned: Any = pl.Trainer(strategy="commd_spawn", accelerator="cpu", devices=2,
                              logger=False).strategy
    assert isinstance(spawned, CommdDDPStrategy) and spawned._start_method == "spawn"
    ddp: Any = StrategyRegistry["ddp"]["strategy"]
    assert ddp is not CommdDDPStrategy  # "ddp" stays Lightning's own DDPStrategy
    options = CommdDDPStrategy(compression="topk:auto", commd_timeout=30,
                               find_unused_parameters=True, timeout=timedelta(seconds=60))
    assert options.commd_options == {"compression": "topk:auto", "timeout": 30.0}
    assert options._ddp_kwargs == {"find_unused_parameters": True}


def _custom_hook(state: object, bucket: Any) -> Any:
    raise AssertionError("never called")


BAD: list[tuple[dict[str, Any], type[BaseException], str]] = [
    ({"compresion": "topk:auto"}, TypeError, "compresion"),
    ({"rank": 1}, TypeError, "rank"),
    ({"compression": 0.01}, TypeError, "compression"),
    ({"socket": ""}, TypeError, "socket"),
    ({"commd_timeout": -1}, ValueError, "commd_timeout"),
    ({"ddp_comm_hook": powerSGD_hook.powerSGD_hook}, CommdError, "PowerSGD"),
    ({"ddp_comm_hook": _custom_hook}, CommdError, "_custom_hook"),
    ({"ddp_comm_hook": default_hooks.fp16_compress_hook,
      "ddp_comm_wrapper": default_hooks.fp16_compress_wrapper}, ValueError, "ddp_comm_wrapper"),
    ({"model_averaging_period": 4}, ValueError, "model_averaging_period"),
    ({"process_group_backend": "nccl"}, ValueError, "process_group_backend='nccl'"),
]


@pytest.mark.parametrize(("options", "error", "names"), BAD,
                         ids=[next(iter(options)) for options, _, _ in BAD])
def test_bad_options_are_refused(options: dict[str, Any], error: type[BaseException],
                                 names: str) -> None:
    from commd_client.lightning import CommdDDPStrategy

    make: Callable[..., Any] = CommdDDPStrategy
    with pytest.raises(error, match=names):
        make(**options)


def test_cuda_is_refused_before_the_process_group() -> None:
    from commd_client.lightning import CommdDDPStrategy

    strategy = CommdDDPStrategy(parallel_devices=[torch.device("cuda", 0)])
    with pytest.raises(CommdError, match="cuda:0"):
        strategy.setup_environment()
    assert not torch.distributed.is_initialized()
