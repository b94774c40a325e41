"""The engine of one worker: one file per stage of a tensor's path.

See :mod:`.facade` for the stages and ARCHITECTURE.md for one gradient's
path through them.
"""

from .facade import Engine
from .pending import Entry, Handle, HandleMap

__all__ = ["Engine", "Entry", "Handle", "HandleMap"]
