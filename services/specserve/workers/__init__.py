"""Ray actors that host the draft and target models and serve the internal gRPC services."""

from specserve.workers.config import RoleResources, WorkersConfig

__all__ = ["RoleResources", "WorkersConfig"]
