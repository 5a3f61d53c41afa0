"""The one error of the wire module."""

from __future__ import annotations

from kvcoord.engine.errors import InvalidArgumentError

__all__ = ["WireError"]


class WireError(InvalidArgumentError):
    """A message that no engine value can be made from (a oneof left unset, an unknown
    name). An engine error of status INVALID_ARGUMENT: the server answers it as such."""
