"""The parts of torch DDP's object that frameworks reach into, on commd's wrapper.

torch's ``DistributedDataParallel`` exposes its C++ ``reducer`` and ``logger``; PyTorch
Lightning and Hugging Face Accelerate call into both (read from their sources, Lightning 2.6
and Accelerate 1.16):

- Lightning's manual optimisation (``pytorch_lightning.overrides.distributed.
  prepare_for_backward``): ``model.reducer._rebuild_buckets()`` then
  ``model.reducer.prepare_for_backward(outputs)``; with ``static_graph`` its ``post_backward``
  calls ``model.reducer._delay_all_reduce()``.
- Lightning's ``DDPStrategy.teardown``: ``model._get_ddp_logging_data().get(
  "can_set_static_graph")``.
- Accelerate's ``trigger_sync_in_backward``: ``model.reducer.prepare_for_backward([])`` after
  forwards run under ``no_sync``, so that the next backward reduces.

torch's own ``_get_ddp_logging_data`` and ``_set_ddp_runtime_logging_sample_rate`` (inherited
by commd's wrapper, a subclass) only read ``self.logger`` and ``self.reducer``: with the two
objects below they work unchanged. Each method says whether it is a real equivalent or a
no-op, and why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._torch_reducer import Reducer

logger = logging.getLogger("commd_client")


class ReducerSurface:
    """torch's ``dist.Reducer`` methods that frameworks call, on commd's ``Reducer``."""

    def __init__(self, reducer: Reducer) -> None:
        self._reducer = reducer
        self.runtime_logging_sample_rate = 100  # torch's kDDPRuntimeLoggingSampleRate

    def prepare_for_forward(self) -> None:
        """Real: fixes whether the coming backward reduces (what the wrapper's forward does)."""
        self._reducer.prepare_forward()

    def prepare_for_backward(self, outputs: Any = ()) -> None:
        """Real: the next backward reduces, whatever the forward decided (torch sets
        ``expect_autograd_hooks_``). ``outputs`` names the tensors torch searches for unused
        parameters; commd finds those itself at the end of the backward, so it is not read.
        Accelerate's ``trigger_sync_in_backward`` runs the forwards under ``no_sync`` and
        calls this before the backward that must reduce."""
        reducer = self._reducer
        wanted = reducer.require_sync
        reducer.require_sync = True  # the decision prepare_forward takes, forced to "reduce"
        try:
            reducer.prepare_forward()
        finally:
            reducer.require_sync = wanted

    def _rebuild_buckets(self) -> bool:
        """No-op, returns False (torch: "nothing rebuilt"): commd lays its buffer out once, in
        the first backward's order, and never rebuilds it."""
        return False

    def _push_all_rebuilt_params(self) -> None:
        """No-op: torch records parameter order here for ``_rebuild_buckets``; see there."""

    def _delay_all_reduce(self) -> None:
        """No-op: torch's static graph defers the first iteration's all-reduce to this call;
        commd's backward has already reduced every gradient when it returns."""

    def _set_forward_pass_work_handle(self, work: Any, divide_by_initial_world_size: bool
                                      ) -> None:
        """No-op: torch's own forward calls it inside ``join()``; commd's forward hands the
        join's work to its reducer itself, and a second handle would rescale twice."""

    def _set_static_graph(self) -> None:
        """No-op: commd's hooks need no graph (``static_graph`` changes nothing here)."""

    def _check_reducer_finalized(self) -> None:
        """No-op: commd's backward returns only once its reduction finished."""

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Kept for ``_get_ddp_logging_data`` (commd samples no runtime statistics)."""
        self.runtime_logging_sample_rate = int(sample_rate)

    def set_logger(self, ddp_logger: DdpLogger) -> None:
        """As torch's: the reducer knows its logger; nothing here reports through it."""
        self._logger = ddp_logger


@dataclass
class DdpLoggingData:
    """torch's ``DDPLoggingData``: ``_get_ddp_logging_data`` merges the two maps."""

    strs_map: dict[str, str] = field(default_factory=dict)
    ints_map: dict[str, int] = field(default_factory=dict)


class DdpLogger:
    """torch's ``dist.Logger`` for commd's wrapper: the construction data torch records, with
    commd's values (``backend_name`` "commd"); runtime statistics are not sampled."""

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.nn.Parameter], *,
                 world_size: int, rank: int, broadcast_buffers: bool,
                 find_unused_parameters: bool, static_graph: bool) -> None:
        self._strs = {
            "backend_name": "commd",
            "module_name": type(module).__name__,
            "device_ids": "",
            "dtypes": ", ".join(sorted({_c_name(p.dtype) for p in params})),
            "comm_hook": "",
        }
        self._ints = {
            "world_size": world_size,
            "rank": rank,
            "output_device": -1,
            "broadcast_buffers": int(broadcast_buffers),
            "find_unused_parameters": int(find_unused_parameters),
            "gradient_as_bucket_view": 1,  # commd's .grad are views of its buffer
            "is_multi_device_module": 0,
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "static_graph": int(static_graph),
            # Lightning suggests static_graph=True when this is set: it would change nothing.
            "can_set_static_graph": 0,
            "join_uneven_inputs": 0,
        }

    def _get_ddp_logging_data(self) -> DdpLoggingData:
        return DdpLoggingData(dict(self._strs), dict(self._ints))

    def _set_comm_hook_name(self, name: str) -> None:
        self._strs["comm_hook"] = name

    def _set_static_graph(self) -> None:
        self._ints["static_graph"] = 1

    def _set_uneven_input_join(self) -> None:
        self._ints["join_uneven_inputs"] = 1

    def set_runtime_stats_and_log(self) -> None:
        """No-op: commd's timings are in ``commd status`` and its metrics, not here."""

    def set_error_and_log(self, message: str) -> None:
        """torch's ``_log_and_throw`` reports here before raising."""
        logger.debug("commd: DistributedDataParallel error: %s", message)


def _c_name(dtype: torch.dtype) -> str:
    """torch's logging names dtypes as C++ does: ``float``, ``double``, ``c10::Half``."""
    return {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
            torch.bfloat16: "c10::BFloat16"}.get(dtype, str(dtype).removeprefix("torch."))
