"""What both managers (:class:`~.manager.RemoteKVCacheManager` and
:class:`~.predicting.PredictingKVCacheManager`) report of their session, read from its
keeper and its Step sender, written once for both."""

from __future__ import annotations

from .sender import StepSender
from .session import SessionKeeper


class SessionFacts:
    """The session's id and its lost requests; the class using it sets ``keeper`` and
    ``sender``."""

    keeper: SessionKeeper
    sender: StepSender

    @property
    def session_id(self) -> str:
        return self.keeper.session_id

    @property
    def lost_requests(self) -> int:
        """Requests reported lost (RequestsLostError) since the manager was created."""
        return self.sender.lost_requests
