"""NCCL through cupy.cuda.nccl: the GPU engine (the GPU issue brings the data path)."""

from __future__ import annotations

import asyncio

import numpy as np

from .base import Engine, EngineConfig, EngineError


class NcclEngine(Engine):
    name = "nccl"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError:
            return False, "cupy is not installed (pip install 'commd[nccl]')"
        if not nccl.available:
            return False, "cupy has no NCCL (install nvidia-nccl-cu12)"
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # cudaErrorInsufficientDriver and friends
            return False, f"no usable GPU ({exc})"
        if count == 0:
            return False, "no GPU found"
        return False, "the NCCL data path is not built yet; use --backend gloo"

    async def start(self, config: EngineConfig) -> None:
        raise EngineError("the NCCL engine is not available in this build")

    def allreduce(self, buffer: np.ndarray, dtype: str) -> asyncio.Future[None]:
        raise EngineError("the NCCL engine is not available in this build")

    def allgather(self, output: np.ndarray, data: np.ndarray, dtype: str) -> asyncio.Future[None]:
        raise EngineError("the NCCL engine is not available in this build")

    def broadcast(self, buffer: np.ndarray, root: int, dtype: str) -> asyncio.Future[None]:
        raise EngineError("the NCCL engine is not available in this build")

    def close(self) -> None:
        pass
