"""Where a pipeline runs: in-process, worker processes, distributed (and Ray)."""

from meshfeed.services.auto import AutoService
from meshfeed.services.base import InProcessService, Service
from meshfeed.services.distributed import DistributedService, check_agreement
from meshfeed.services.passes import PassService
from meshfeed.services.ray import LoaderActorError, RayService, RemoteBatch
from meshfeed.services.thread import ThreadService
from meshfeed.services.workers import WorkerError, WorkerService

__all__ = [
    "AutoService",
    "DistributedService",
    "InProcessService",
    "LoaderActorError",
    "PassService",
    "RayService",
    "RemoteBatch",
    "Service",
    "ThreadService",
    "WorkerError",
    "WorkerService",
    "check_agreement",
]
