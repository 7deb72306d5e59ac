"""Per-request sessions over the draft and target workers (see `core`), what they run by placement
(`drivers`), and where the coordinator runs (`hosting`)."""

from specserve.coordinator.core import Chunk, Coordinator, Overloaded, SessionRequest
from specserve.coordinator.drivers import ColocatedRelay, SplitDriver
from specserve.coordinator.hosting import ActorCoordinator, InReplicaCoordinator, start_coordinator

__all__ = ["ActorCoordinator", "Chunk", "ColocatedRelay", "Coordinator", "InReplicaCoordinator", "Overloaded",
           "SessionRequest", "SplitDriver", "start_coordinator"]
