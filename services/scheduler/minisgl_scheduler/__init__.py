"""minisgl scheduler: requests, KV pages, slots and the radix prefix cache; drives a StepExecutor.

Torch-free. `Scheduler` is the one copy of the logic; the gRPC service (server.py) and the in-process
`minisgl.LLM` both wrap it.
"""

from minisgl_scheduler.config import SchedulerConfig
from minisgl_scheduler.errors import (
    ContextLengthExceeded,
    ErrorCode,
    InvalidRequest,
    Overloaded,
    SchedulerError,
    WorkerFailed,
)
from minisgl_scheduler.request import FinishReason, TokenEvent
from minisgl_scheduler.scheduler import Scheduler
from minisgl_scheduler.stats import SchedulerStats

__all__ = [
    "ContextLengthExceeded",
    "ErrorCode",
    "FinishReason",
    "InvalidRequest",
    "Overloaded",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStats",
    "TokenEvent",
    "WorkerFailed",
]
