"""Writes ``start_snapshot_journal/``: a data directory as kvcoord before 863d21c left
it (test_start_snapshot_journal.py reads it). Run from a tree whose
``server/kvcoord/service/recovery.py`` is that of 863d21c~1 (the start snapshot taken
before the instance's restore generation was set):

    git checkout 863d21c~1 -- server/kvcoord/service/recovery.py
    PYTHONPATH=$PWD/client:$PWD/server:$PWD/tests python tests/reliability/data/make_start_snapshot_journal.py
    git checkout HEAD -- server/kvcoord/service/recovery.py

The scenario of test_restore_lost_restart.py's
``test_a_snapshot_at_the_start_of_an_instance_after_a_restore_replays_its_answers``:
worker a allocates a1, the volume is copied, a2 is allocated, the copy is restored and
a's fence proves it (a restore generation begins), worker d attaches after the grace;
a restart with ``snapshot_every = 3`` snapshots at its own start record; worker d
allocates d1 (told under the generation's key); SIGKILL. Worker d's session and what
it was told go to ``worker-d.json``."""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from durable_server import copy_volume, leased_server, prove_restore_then_attach, step_allocate
from kvcoord.client import NO_RETRY, KVCoordClient

HERE = Path(__file__).resolve().parent
OUT = HERE / "start_snapshot_journal"
LEASE = 10.0  # (a session outlives a start on a loaded machine)
NUM_BLOCKS = 17


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvcoord-fixture-"))
    server = leased_server(tmp, LEASE, num_blocks=NUM_BLOCKS)
    server.start()
    copy = tmp / "volume-snapshot"
    try:
        with KVCoordClient(server.address) as c:
            a = c.attach("p", "sha256_cbor", 4, "0", "worker-a", lease_seconds=LEASE)
            step_allocate(c, a, "a1", 8)
            copy_volume(server, copy)
            a.fence.CopyFrom(c.step("p", [], a.session_id, a.fence).fence)
            step_allocate(c, a, "a2", 8)
        d = prove_restore_then_attach(server, copy, a, "a3", LEASE)
        server.config.write_text(
            server.config.read_text().replace("snapshot_every = 2000", "snapshot_every = 3")
        )
        server.kill()
        server.start()
        journal = sqlite3.connect(server.data_dir / "journal.sqlite")
        for _ in range(500):
            if journal.execute("SELECT count(*) FROM snapshots").fetchone()[0]:
                break
            time.sleep(0.01)
        else:
            sys.exit("no snapshot at the start record")
        journal.close()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            held = step_allocate(c, d, "d1", 8)
            fence = c.heartbeat(d.session_id, d.fence).fence
        server.kill()
    finally:
        server.stop()
    shutil.rmtree(OUT, ignore_errors=True)
    shutil.copytree(server.data_dir, OUT)
    db = sqlite3.connect(OUT / "journal.sqlite")  # the WAL into the file, as one small file
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    for extra in [*OUT.glob("journal.sqlite-*"), OUT / "kvcoord.lock"]:  # (a lock: this process's)
        extra.unlink(missing_ok=True)
    (OUT / "worker-d.json").write_text(
        json.dumps(
            {
                "session_id": d.session_id,
                "fence": {
                    "instance_id": fence.instance_id,
                    "incarnation": fence.incarnation,
                    "term": fence.term,
                    "position": fence.position,
                    "position_tag": fence.position_tag.hex(),
                },
                "d1": held,
                "lease": LEASE,
                "num_blocks": NUM_BLOCKS,
            },
            indent=1,
        )
        + "\n"
    )
    shutil.rmtree(tmp)
    print(sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
