"""Per-request sessions over the draft and target workers (see `core`)."""

from specserve.coordinator.core import Chunk, Coordinator, Overloaded, SessionRequest, start_coordinator

__all__ = ["Chunk", "Coordinator", "Overloaded", "SessionRequest", "start_coordinator"]
