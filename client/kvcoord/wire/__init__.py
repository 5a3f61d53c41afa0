"""kvcoord's wire conversions, written once for both sides: engine values <-> messages.

Shipped in the workers' distribution (kvcoord-client) next to the engine; the server
depends on it. It imports only the engine, the generated messages (kvcoord.v1),
protobuf and the standard library (tests/unit/test_layers.py):

- :mod:`.layouts`  PoolConfig <-> the engine's KVCacheConfig, and a pool's table form
  (config files, conformance traces)
- :mod:`.values`   block ids, prefix hits, LoRA adapters, prefix-cache statistics, the
  order of ScorePools answers (`score_rank`)
- :mod:`.events`   KV events and the events digest
- :mod:`.mamba`    vLLM 0.33's boundary-state offloads and copy-on-write pairs
- :mod:`.state`    an exclusive session's pool state (AttachResponse.pool_state)
- :mod:`.hashes`   contract facts about block hashes (digest lengths)
- :mod:`.leases`   contract facts about session leases (the client's margin)
- :mod:`.pem`      PEM certificate and key readers (client channels, server listeners)
- :mod:`.columns`  a DecodeOp's packed columns (little-endian uint32 arrays; imported from
  the module itself, not re-exported here)
"""

from .errors import WireError
from .events import (
    add_events,
    event_from_pb,
    event_to_pb,
    events_digest,
    events_from_pb,
    events_message_digest,
    fill_event,
)
from .hashes import HASH_LENGTHS
from .layouts import (
    MAX_MODEL_LEN_UNLIMITED,
    ConfigFileError,
    config_from_pb,
    group_kinds,
    pool_config_from_table,
    spec_from_pb,
    string_list,
    tables,
)
from .leases import LEASE_MARGIN
from .mamba import copies_from_pb, copies_to_pb, offloads_from_pb, offloads_to_pb
from .state import ReplicaState, pool_state_from_pb, write_pool_state
from .values import (
    STATS_FIELDS,
    allocate_op,
    block_ids_to_pb,
    extra_key_sources_from_pb,
    free_op,
    hit_from_pb,
    hit_to_pb,
    ids_from_pb,
    lora_from_pb,
    score_rank,
    stats_from_pb,
    stats_to_pb,
    uncomputed_from_pb,
    write_extra_key_sources,
    write_ids,
)

__all__ = [
    "HASH_LENGTHS",
    "LEASE_MARGIN",
    "MAX_MODEL_LEN_UNLIMITED",
    "STATS_FIELDS",
    "allocate_op",
    "ConfigFileError",
    "ReplicaState",
    "WireError",
    "add_events",
    "block_ids_to_pb",
    "config_from_pb",
    "copies_from_pb",
    "copies_to_pb",
    "event_from_pb",
    "event_to_pb",
    "events_digest",
    "events_from_pb",
    "events_message_digest",
    "fill_event",
    "free_op",
    "group_kinds",
    "hit_from_pb",
    "hit_to_pb",
    "ids_from_pb",
    "extra_key_sources_from_pb",
    "lora_from_pb",
    "score_rank",
    "offloads_from_pb",
    "offloads_to_pb",
    "pool_config_from_table",
    "pool_state_from_pb",
    "spec_from_pb",
    "stats_from_pb",
    "stats_to_pb",
    "string_list",
    "tables",
    "uncomputed_from_pb",
    "write_extra_key_sources",
    "write_ids",
    "write_pool_state",
]
