"""Debug tools: a collective counter with provenance and a live-storage tracker.

Both are ``TorchDispatchMode``s, so they see ops above every tensor subclass:
what ``torch.utils.checkpoint``'s policy sees, including ops run by a
checkpoint recompute inside backward. Unlike ``CommDebugMode`` (which counts per
module), the counter attributes each collective to the FSDP parameter or bucket
whose tag its input carries, and tells forward from backward by the autograd
engine, not by module hooks.
"""

from .._param import disable_tagging
from .counter import CollectiveCounter, CollectiveEvent
from .memory import LiveStorageTracker

__all__ = ["CollectiveCounter", "CollectiveEvent", "LiveStorageTracker", "disable_tagging"]
