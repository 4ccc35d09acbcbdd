"""The engine-facing API: a scheduler role and a worker role, like vLLM V1's KV connector."""

from .metadata import ConnectorMetadata, LoadSpec, SaveSpec
from .scheduler import SchedulerConnector
from .worker import WorkerConnector

__all__ = ["ConnectorMetadata", "LoadSpec", "SaveSpec", "SchedulerConnector", "WorkerConnector"]
