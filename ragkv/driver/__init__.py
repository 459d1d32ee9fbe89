"""The answer driver: prefill pieces between batched decode steps, for the server and (a batch of one) the library."""

from ragkv.driver.jobs import DecodeCounters, Event, Job, JobRequest, QueueFullError, ServedEngine, queued_post
from ragkv.driver.scheduler import Scheduler, TimedPieces, answer_inline

__all__ = [
    "DecodeCounters",
    "Event",
    "Job",
    "JobRequest",
    "QueueFullError",
    "Scheduler",
    "ServedEngine",
    "TimedPieces",
    "answer_inline",
    "queued_post",
]
