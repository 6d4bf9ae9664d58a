"""Constants of the buffers shared between a rank and its daemon (CUDA IPC on GPUs)."""

from __future__ import annotations

IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE: cudaIpcMemHandle_t and cudaIpcEventHandle_t
INTERPROCESS_EVENT_FLAGS = 6  # cudaEventInterprocess | cudaEventDisableTiming
