"""[[kv_events]]: the publisher settings a config file may give, checked on load."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvcoord.service.config import ConfigFileError, parse_config
from kvcoord.service.kv_publisher import (
    RESERVE_SEQUENCES,
    KVEventsDecl,
    SequenceReservation,
    reservation_path,
)


def test_kv_events_tables_load_with_vllms_keys() -> None:
    """vLLM's KVEventsConfig keys (endpoint, replay_endpoint, topic, buffer_steps, hwm)
    plus pool, tenant, int_hashes and data_parallel_rank; defaults as vLLM's."""
    assert parse_config(
        '[tenants.t]\ntokens = ["0123456789abcdef0123456789abcdef"]\n[[kv_events]]\npool = "a"\ntenant = "t"\n'
    )
    cfg = parse_config(
        '[[kv_events]]\npool = "a"\nendpoint = "tcp://*:5557"\nreplay_endpoint = "tcp://*:5558"\n'
        'topic = "kv@a"\nint_hashes = true\n\n[[kv_events]]\npool = "b"\n'
    )
    assert cfg.kv_events == (
        KVEventsDecl("a", "tcp://*:5557", "tcp://*:5558", "kv@a", int_hashes=True),
        KVEventsDecl("b"),
    )
    assert (KVEventsDecl("b").buffer_steps, KVEventsDecl("b").hwm) == (10_000, 100_000)
    # vLLM 0.16 and 0.33 both default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES to 1: integer hashes
    assert KVEventsDecl("b").int_hashes is True


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[kv_events]\npool = 'a'\n", "array of tables"),
        ("[[kv_events]]\nendpoint = 'tcp://*:1'\n", r"kv_events\[0\]\.pool: required"),
        ("[[kv_events]]\npool = 'a'\nport = 3\n", "unknown key"),
        ("[[kv_events]]\npool = 'a'\nhwm = '10'\n", r"kv_events\[0\]\.hwm: must be an int"),
        ("[[kv_events]]\npool = 'a'\nhwm = 0\n", "must be >= 1"),
        ("[[kv_events]]\npool = 'a'\nint_hashes = 1\n", r"int_hashes: must be a bool"),
        ("[[kv_events]]\npool = 'a'\n[[kv_events]]\npool = 'a'\n", "has a publisher already"),
        # a tenant that does not exist would never publish anything
        (
            "[[kv_events]]\npool = 'a'\ntenant = 'team-x'\n",
            r"kv_events\[0\]\.tenant: 'team-x' is not a tenant",
        ),
        (
            "[tenants.team-a]\ntokens = ['0123456789abcdef0123456789abcdef']\n"
            "[[kv_events]]\npool = 'a'\ntenant = 'team-b'\n",
            r"'team-b' is not a tenant of \[tenants\] \(known: \['team-a'\]\)",
        ),
    ],
)
def test_bad_kv_events_tables_name_the_key(text: str, match: str) -> None:
    """A wrong table fails on load with the key path and what was expected."""
    with pytest.raises(ConfigFileError, match=match):
        parse_config(text)


def test_batch_numbers_reserved_in_the_data_dir_are_never_used_twice(tmp_path: Path) -> None:
    """A publisher's batch numbers survive a restart: each start begins at the ceiling
    stored before any number under it was used (never below a used one); a damaged
    file is refused naming it."""
    path = reservation_path(tmp_path, "p")
    first = SequenceReservation(path, "p")
    assert first.start == 0
    for seq in range(RESERVE_SEQUENCES + 10):
        first.allow(seq)
        assert SequenceReservation(path, "p").start > seq  # a crash now: the restart starts past seq
    second = SequenceReservation(path, "p")
    assert second.start == first.ceiling >= RESERVE_SEQUENCES + 10
    assert reservation_path(tmp_path, "q") != path
    path.write_text("{")
    with pytest.raises(ValueError, match=str(path)):
        SequenceReservation(path, "p")
