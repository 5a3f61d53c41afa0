"""A shared pool moving between replicas while its workers run on a faulty network (real
replica processes, real etcd, real gRPC): three workers of two tenants share one pool
(the same prompts, unsalted: only the tenants' cache namespaces keep them apart), hit
each other's prefixes and evict each other's blocks, their answers lost, late, duplicated and
re-delivered, while a replica joins and leaves again and again (each join and each
graceful leave hands the pool over with its sessions) and is SIGKILLed once (the pool
comes back from its journal). After every step each worker's record of its requests'
block tables equals the pool's, wherever it is, and every prefix hit reads blocks whose
(modelled) KV is the prefix its own tenant wrote."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from durable_server import env
from durable_workload import PATIENT
from etcd_process import Etcd
from kvcoord.client import KVCoordClient, KVCoordError
from kvcoord.client.faults import FaultInjector
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.service.ownership import Member, owner_of
from shared_workers import NUM_BLOCKS, KVMemory, run_beside, shared_config, shared_worker
from test_handover import wait_placed
from test_replicas import replica_config

ROOT = "tok-root"
TENANTS = {"alice": "tok-alice", "bob": "tok-bob"}


def _moving_name() -> str:
    """A pool name placed on r0 among r0 and r1, and on r2 once r2 is a member."""
    two = [Member("r0", ""), Member("r1", "")]
    three = [*two, Member("r2", "")]
    return next(
        name
        for name in (f"shared{n}" for n in range(1000))
        if owner_of(name, two).replica_id == "r0" and owner_of(name, three).replica_id == "r2"  # type: ignore[union-attr]
    )


@pytest.mark.long
@pytest.mark.parametrize("journal", ["local", "store"])
def test_a_shared_pool_handed_back_and_forth_under_faults_keeps_every_workers_blocks(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, journal: str
) -> None:
    """With ``journal = "local"`` the killed replica's pool waits for it and comes back
    from its own journal; with ``"store"`` r0 takes it over from the cluster store at once
    (failover), and r2, started again, is handed it at the next round."""
    cluster = request.node.name.replace("[", "-").rstrip("]")
    pool = _moving_name()
    procs: dict[str, ServerProcess] = {}
    started: list[tuple[str, ServerProcess]] = []  # every start, in order (r2 starts again)
    lines = 'journal = "store"\n' if journal == "store" else ""

    tenants = "".join(
        f'[tenants.{name}]\ntokens = ["{token}"]\n'
        f'grants = [{{ pools = ["{pool}"], roles = ["use", "observe", "administer"] }}]\n'
        for name, token in TENANTS.items()
    )

    def start(replica: str) -> ServerProcess:
        config = replica_config(
            etcd, replica, tmp_path / replica, cluster, f'auth_tokens = ["{ROOT}"]\n', lines
        )  # (the replicas hand pools over with the full-access token)
        procs[replica] = start_server(config + tenants, env=env())
        started.append((replica, procs[replica]))
        return procs[replica]

    def who(address: str) -> str:
        """The replica processes (each start of one) that listened at ``address``."""
        named = [f"{r} (start {n})" for n, (r, p) in enumerate(started) if p.address == address]
        return ", ".join(named) or f"no replica of this test at {address!r}"

    memory = KVMemory()
    counts: dict[str, int] = dict.fromkeys(
        ("steps", "hits", "refusals", "preemptions", "evictions", "lost"), 0
    )
    injectors: list[FaultInjector] = []
    done = threading.Event()
    moves: list[str] = []
    try:
        start("r0"), start("r1")
        targets = [procs["r0"].address, procs["r1"].address]
        with KVCoordClient(procs["r0"].address, token=ROOT) as c:  # r0's whatever its view of r1
            assert c.create_pool(pool, shared_config()).pool.replica == "r0"
        wait_placed(targets, {pool: "r0"}, token=ROOT)  # r1 sees it there too

        def churn() -> None:
            """r2 joins (the pool moves to it) and leaves (back to r0), round after
            round; once it is SIGKILLed instead and started again from its journal."""
            rounds = 0
            while not done.is_set() and rounds < 5:
                rounds += 1
                start("r2")
                wait_placed([procs["r0"].address, procs["r2"].address], {pool: "r2"}, token=ROOT)
                moves.append(f"to r2 ({rounds})")
                done.wait(1.0)
                if rounds == 3:
                    procs["r2"].proc.kill()
                    procs["r2"].stop()
                    if journal == "store":  # r0 rebuilds it from the store once r2's lease ends
                        wait_placed([procs["r0"].address, procs["r1"].address], {pool: "r0"}, token=ROOT)
                        moves.append("r2 killed, failed over to r0")
                        done.wait(1.0)
                    start("r2")  # local: its journal has the pool, claimed again; store: handed to it
                    wait_placed([procs["r0"].address, procs["r2"].address], {pool: "r2"}, token=ROOT)
                    moves.append("r2 killed and back")
                    done.wait(1.0)
                assert procs["r2"].stop() == 0  # SIGTERM: handed back to r0 within the grace
                wait_placed([procs["r0"].address, procs["r1"].address], {pool: "r0"}, token=ROOT)
                moves.append(f"back to r0 ({rounds})")
                done.wait(1.0)

        def worker(wid: int) -> None:
            tenant = "alice" if wid % 2 == 0 else "bob"  # the same prompts: kept apart by namespace
            # (patient: with journal = "local" the pool waits for r2 SIGKILLed and started
            # again, which took 20-35 s at load 25-30, past the default policy's 8 attempts)
            try:
                shared_worker(
                    targets,
                    pool,
                    wid,
                    90,
                    memory,
                    counts,
                    injectors,
                    tenant,
                    TENANTS[tenant],
                    ROOT,
                    retry=PATIENT,
                )
            except KVCoordError as exc:  # which replica said it (a refusal no replica should give)
                raise AssertionError(f"{exc} (answered by {who(exc.address)}; moves {moves})") from exc

        run_beside(worker, 3, churn, done)
        with KVCoordClient(targets, token=ROOT) as c:
            final = c.get_stats(pool)
            assert c.check_pool(pool).violations == []
    except BaseException:  # every start's warnings and errors, to tell what the replicas did
        for n, (replica, p) in enumerate(started):
            lines = [line for line in p.log().splitlines() if " WARNING " in line or " ERROR " in line]
            print(f"--- {replica} (start {n}) at {p.address}:", *lines[-40:], sep="\n")
        raise
    finally:
        for p in procs.values():
            p.stop()
    faults = {k: sum(fi.counts[k] for fi in injectors) for k in injectors[0].counts}
    print(f"shared pool moving under faults: {counts} faults {faults} moves {moves}")
    assert counts["steps"] == 3 * 90 and counts["lost"] == 0
    assert counts["hits"] > 30 and counts["refusals"] > 0
    assert len(moves) >= 4, moves
    assert final.num_requests == 0 and final.num_free_blocks == NUM_BLOCKS - 1, final
