"""Per-request sessions over the draft and target workers (see `core`), and where they run (`hosting`)."""

from specserve.coordinator.core import Chunk, Coordinator, Overloaded, SessionRequest
from specserve.coordinator.hosting import ActorCoordinator, InReplicaCoordinator, start_coordinator

__all__ = ["ActorCoordinator", "Chunk", "Coordinator", "InReplicaCoordinator", "Overloaded", "SessionRequest",
           "start_coordinator"]
