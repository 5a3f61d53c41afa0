"""Contract facts about session leases, the same on both sides: the client's safety margin.

A worker keeps part of every lease the server grants as a margin (clock rates differ; an
answer takes time to come back): it renews before, and stops trusting its session at,
``(1 - LEASE_MARGIN) x lease`` after it sent the call that granted or renewed it
(kvcoord.client.session). The server refuses a lease too short to outlast, after that
margin, the longest durable-write stall it waits out (kvcoord.service.stalls).
"""

from __future__ import annotations

__all__ = ["LEASE_MARGIN"]

#: the part of a granted lease a client keeps as a safety margin
LEASE_MARGIN = 0.05
