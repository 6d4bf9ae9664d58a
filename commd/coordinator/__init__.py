"""The job-wide decisions, made by the daemon on rank 0's node: forming a job, planning and
re-planning it, measuring plans."""

from commd.coordinator.coordinator import Coordinator

__all__ = ["Coordinator"]
