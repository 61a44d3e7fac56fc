"""Settings that change how hop operators behave. Assign at run time::

hop.config.validate = "always"
"""

from __future__ import annotations

from typing import Literal

__all__ = ["validate", "validation_cache_size"]

#: When eager ``cond`` / ``switch`` check that every branch (also the ones not
#: taken) returns the same structure, dtypes, devices and ranks, by running the
#: branches once on fake tensors: ``"once"`` per signature (the branches' code,
#: the operands' metadata and what the branches close over; the default),
#: ``"always"`` (every call), or ``"never"``.
validate: Literal["once", "always", "never"] = "once"

#: How many signatures the "once" verdict cache remembers before it starts over
#: (a positive int; another value raises HopTypeError or HopValueError at the
#: next validation).
validation_cache_size: int = 1024
