"""torch DDP's surface that Lightning and Accelerate call, on commd's wrapper (issue 35, item 2).

``tests/ddp_surface_worker.py`` replays the framework code that reaches into torch's DDP
object (copied from PyTorch Lightning 2.6 and Accelerate 1.16, which are not installed here)
on two ranks, torchrun's environment, a Gloo process group and one real commd daemon; every
scenario runs with stock torch DDP and then with commd's wrapper from the same seeds, and
the tests compare the two per rank (parameters and buffers to 1e-5):

- Lightning's manual optimisation: ``model.reducer._rebuild_buckets()`` /
  ``prepare_for_backward`` in ``manual_backward`` and its forward redirection, which turns
  ``require_backward_grad_sync`` off inside the forward; torch then leaves
  ``require_forward_param_sync`` off, so later forwards do not broadcast buffers: the
  BatchNorm statistics differ between ranks, exactly as torch's do. Set back on, the next
  forward syncs them.
- Accelerate's ``trigger_sync_in_backward``: forwards under ``no_sync``, then
  ``model.reducer.prepare_for_backward([])`` must make the next backward reduce.
- ``_get_ddp_logging_data()`` (Lightning's teardown), ``_set_ddp_runtime_logging_sample_rate``
  and the reducer's no-ops.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from commd.testing.daemons import LocalDaemon, gloo_daemons
from commd.testing.ports import free_port
from commd.testing.processes import FinishTimeout, finish, kill_all

WORKER = Path(__file__).parents[1] / "ddp_surface_worker.py"
WORLD_SIZE = 2
RUN_TIMEOUT_S = 90.0  # all scenarios, both implementations: ~15 s on two cores when it works
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "COMMD_JOB",
                  "COMMD_SOCKET", "COMMD_COORDINATOR")

pytestmark = pytest.mark.timeout(int(RUN_TIMEOUT_S) + 60)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """Each rank's {scenario: {"torch": result, "commd": result}}."""
    out = tmp_path_factory.mktemp("surface")
    with gloo_daemons(tmp_path_factory.mktemp("surface-daemons"), ("d0",)) as (node,):
        yield run_ranks(node, out)


def run_ranks(node: LocalDaemon, out: Path) -> list[dict[str, Any]]:
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    port = free_port()
    processes: list[subprocess.Popen[bytes]] = []
    problem = ""
    try:
        for rank in range(WORLD_SIZE):
            env = {**base, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "COMMD_SOCKET": node.socket, "COMMD_COORDINATOR": node.address,
                   "COMMD_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
            processes.append(subprocess.Popen([sys.executable, str(WORKER), str(out)], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for rank, done in enumerate(finish(processes, RUN_TIMEOUT_S)):
            if done.returncode != 0:
                problem += f"rank {rank} exited {done.returncode}: {done.stdout[-3000:]!r}\n"
    except FinishTimeout as timeout:
        problem = f"timed out: {timeout}"
    finally:
        kill_all(processes)
    found = []
    for rank in range(WORLD_SIZE):
        path = out / f"rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote nothing. {problem}")
        found.append(torch.load(path))
    if problem:
        pytest.fail(problem)
    return found


def outcome(records: list[dict[str, Any]], scenario: str, impl: str) -> list[dict[str, Any]]:
    """Every rank's result of one scenario; fails with the traceback if one raised."""
    results = []
    for rank, record in enumerate(records):
        result = record.get(scenario, {}).get(impl)
        assert result is not None, f"rank {rank} never ran {scenario}/{impl}"
        if "error" in result:
            pytest.fail(f"{scenario}/{impl} raised on rank {rank}: {result['error']}\n"
                        f"{result['traceback']}")
        results.append(result)
    return results


def assert_like_torch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                      where: str) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key].double(), want[key].double(), rtol=0, atol=1e-5,
                                   msg=lambda m, key=key: f"{where} {key}: {m}")


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> bool:
    return any(not torch.allclose(a[k].double(), b[k].double(), atol=1e-5) for k in keys)


def test_lightning_manual_optimisation_as_torch(records: list[dict[str, Any]]) -> None:
    torch_runs = outcome(records, "lightning_manual", "torch")
    commd_runs = outcome(records, "lightning_manual", "commd")
    for rank, (got, want) in enumerate(zip(commd_runs, torch_runs, strict=True)):
        assert got["flags"] == want["flags"] == [False] * 3  # Lightning left it off
        assert_like_torch(got["trained"], want["trained"], f"rank {rank} trained")
        assert_like_torch(got["synced"], want["synced"], f"rank {rank} after sync back on")
    buffers = torch_runs[0]["buffers"]
    stats = [k for k in buffers if not k.endswith("num_batches_tracked")]
    # While off, no broadcast: each rank keeps its own BatchNorm statistics (torch and commd)
    for runs in (torch_runs, commd_runs):
        assert differ(runs[0]["trained"], runs[1]["trained"], stats)
        params = [k for k in runs[0]["trained"] if k not in buffers]
        assert not differ(runs[0]["trained"], runs[1]["trained"], params)
        # Back on: the next forward broadcast rank 0's buffers
        assert not differ(runs[0]["synced"], runs[1]["synced"], list(runs[0]["synced"]))


def test_accelerate_trigger_sync_in_backward_reduces(records: list[dict[str, Any]]) -> None:
    torch_runs = outcome(records, "accelerate_trigger", "torch")
    commd_runs = outcome(records, "accelerate_trigger", "commd")
    for rank, (got, want) in enumerate(zip(commd_runs, torch_runs, strict=True)):
        assert_like_torch(got["trained"], want["trained"], f"rank {rank}")
    params = [k for k in commd_runs[0]["trained"] if k not in commd_runs[0]["buffers"]]
    assert not differ(commd_runs[0]["trained"], commd_runs[1]["trained"], params)


def test_logging_data_and_reducer_no_ops(records: list[dict[str, Any]]) -> None:
    torch_runs = outcome(records, "logging_surface", "torch")
    commd_runs = outcome(records, "logging_surface", "commd")
    for rank, (got, want) in enumerate(zip(commd_runs, torch_runs, strict=True)):
        data = got["data"]
        for key in ("world_size", "rank", "module_name", "broadcast_buffers",
                    "find_unused_parameters", "num_parameter_tensors",
                    "total_parameter_size_bytes", "dtypes", "device_ids", "output_device",
                    "is_multi_device_module", "comm_hook"):
            assert data[key] == want["data"][key], key
        assert data["rank"] == rank
        assert data["backend_name"] == "commd"
        # Lightning's teardown: no static-graph suggestion from either
        assert got["suggest_static_graph"] is want["suggest_static_graph"] is False
        assert got["refused_rate_0"] == want["refused_rate_0"] == "ValueError"
        assert got["rebuilt_type"] == want["rebuilt_type"] == "bool"
        assert got["grads_unchanged"]


def test_the_surface_has_what_frameworks_reach_for() -> None:
    """Without a daemon: every reducer and logger method named here is one of torch's (so
    the names frameworks call are the real ones) and exists on commd's surface objects."""
    from commd_client._torch_surface import DdpLogger, ReducerSurface

    for name in ("prepare_for_forward", "prepare_for_backward", "_rebuild_buckets",
                 "_push_all_rebuilt_params", "_delay_all_reduce", "_set_forward_pass_work_handle",
                 "_set_static_graph", "_set_ddp_runtime_logging_sample_rate", "set_logger"):
        assert callable(getattr(ReducerSurface, name)), name
        assert hasattr(torch._C._distributed_c10d.Reducer, name), name
    for name in ("_get_ddp_logging_data", "_set_comm_hook_name", "_set_static_graph",
                 "_set_uneven_input_join", "set_runtime_stats_and_log", "set_error_and_log"):
        assert callable(getattr(DdpLogger, name)), name
        assert hasattr(torch._C._distributed_c10d.Logger, name), name
