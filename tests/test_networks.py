"""Jobs across machines with addresses of their own: each machine a network namespace
(tests/netns.py), reaching the others only through 10.213.X.i on a bridge, with a hostname
that resolves to loopback as on a stock Debian or Ubuntu install. The head is the test's own
agent, bound to the bridge's address; `elastic-magic join` agents run in the namespaces."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import pytest
from netns import network as network  # the fixture
from netns import network_of
from test_elastic import STEPS, TRAIN, assert_same_parameters, committed_steps, done_steps
from test_elastic import baseline as baseline  # the module-scoped fixture

import elastic_magic as em
from elastic_magic.agent.handles.job import Job
from elastic_magic.agent.node.network import choose, is_loopback
from elastic_magic.ui.dashboard_state import DashboardState
from elastic_magic.ui.describe import network_text
from elastic_magic.wire.events import (
    AcceptingNodes,
    Excluded,
    NetworkChosen,
    NodeConnected,
    RendezvousCompleted,
)
from elastic_magic.wire.payload import build_payload

pytestmark = pytest.mark.cluster

PARAMETERS = "[p.detach().clone() for p in model.module.parameters()]"
assert TRAIN.rstrip().endswith(PARAMETERS)
# The same training; each rank also tells where its process group met and how it talks.
TRAIN_AND_TELL = TRAIN.replace(PARAMETERS, f"({PARAMETERS}, os.environ['MASTER_ADDR'], "
                                           "os.environ.get('GLOO_SOCKET_IFNAME'))")
# The same training, slow only until the machine that joins mid-run has arrived.
TRAIN_UNTIL_JOINED = TRAIN.replace("time.sleep(PAUSE)", "time.sleep(PAUSE if world < 3 else 0)")
assert TRAIN_UNTIL_JOINED != TRAIN


def run_head(spec, source, recorder, *, namespace=None, on_open=None, drive=None):
    """The head's job to its end; ``on_open(job, endpoint)`` once machines may join,
    ``drive(job)`` on a thread alongside."""
    job = Job(spec, build_payload(source, spec, namespace=namespace or {})).start()

    def render(events):
        recorder(events)
        for event in events:
            if isinstance(event, AcceptingNodes) and on_open is not None:
                on_open(job, event.endpoint)

    driver = threading.Thread(target=drive, args=(job,), daemon=True) if drive else None
    if driver:
        driver.start()
    result = job.wait(render)
    if driver:
        driver.join(timeout=10)
    return result


@pytest.mark.parametrize("network", [1], indirect=True)
def test_the_interface_is_the_one_carrying_the_address_unless_the_user_named_one(
        network, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    chosen = choose(network.head_address, {})
    assert chosen.machine == network.head_address and chosen.interface == network.bridge
    assert chosen.variables == (("GLOO_SOCKET_IFNAME", network.bridge),
                                ("NCCL_SOCKET_IFNAME", network.bridge))
    # The agent's own environment wins, as does the job's --env (which every machine gets).
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    chosen = choose(network.head_address, {"NCCL_SOCKET_IFNAME": "ib0"})
    assert chosen.variables == ()
    assert chosen.kept == (("GLOO_SOCKET_IFNAME", "mine"), ("NCCL_SOCKET_IFNAME", "ib0"))
    # All machines on this host (loopback): their process groups stay on loopback.
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    chosen = choose("127.0.0.1", {})
    assert chosen.variables == (("GLOO_SOCKET_IFNAME", "lo"), ("NCCL_SOCKET_IFNAME", "lo"))
    assert network_text(chosen).endswith("only machines on this host can take part; its "
                                         "workers stay on lo")


def test_three_machines_train_to_the_single_machine_parameters(
        baseline, network, log_dir, recorder):
    # The user's NCCL_SOCKET_IFNAME wins on every machine; gloo's interface is chosen per
    # machine (without it, each rank offers 127.0.0.1 or 127.0.1.1 and the group fails).
    spec = em.JobSpec.create(1, nnodes=3, rdzv_endpoint=network.head_address,
                             env=["NCCL_SOCKET_IFNAME=eth9"], log_dir=log_dir, timeout=60)
    joined = []

    def on_open(job, endpoint):
        joined.extend(network.join(i, endpoint, job.token) for i in (1, 2))

    result = run_head(spec, TRAIN_AND_TELL, recorder, namespace={"KILL_AT": -1, "PAUSE": 0.0},
                      on_open=on_open)
    outputs = [network.output(proc) for proc in joined]
    assert result.ok, (result, outputs)
    assert [proc.wait(timeout=30) for proc in joined] == [0, 0], outputs
    assert [(r.world_size, r.nnodes) for r in recorder.of(RendezvousCompleted)] == [(3, 3)]
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0][0], baseline, atol=1e-5)
    # Every rank met at the address of one machine as the others reach it (10.213.X.i), and
    # used its own machine's interface: the head's bridge, eth0 in the namespaces.
    addresses = {network.head_address, network.address(1), network.address(2)}
    assert len({master for _, master, _ in result.values.values()}) == 1
    assert {master for _, master, _ in result.values.values()} <= addresses
    assert sorted(interface for _, _, interface in result.values.values()) == sorted(
        [network.bridge, "eth0", "eth0"])
    # Each machine chose its own interface and said so, in the notebook and on its terminal.
    chosen = {e.machine: e for e in recorder.of(NetworkChosen)}
    assert sorted(chosen) == sorted([network.head_address, network.address(1),
                                     network.address(2)]), chosen
    for machine, event in chosen.items():
        interface = network.bridge if machine == network.head_address else "eth0"
        assert event.interface == interface
        assert event.variables == (("GLOO_SOCKET_IFNAME", interface),)
        assert event.kept == (("NCCL_SOCKET_IFNAME", "eth9"),)
    dashboard = DashboardState(result.run_id, str(result.log_dir), 0)
    for event in recorder.events:
        dashboard.apply(event)
    notes = [entry["text"] for entry in dashboard.timeline if entry["kind"] == "network"]
    assert len(notes) == 3 and any(f"through {network.bridge}" in n for n in notes), notes
    for i, proc in enumerate(joined, 1):
        assert chosen[network.address(i)].hostname == network.hostname(i)
        assert chosen[network.address(i)].hostname_is_loopback
        assert (f"machine {network.address(i)}: its workers reach the others through eth0 "
                f"(GLOO_SOCKET_IFNAME); kept your NCCL_SOCKET_IFNAME=eth9. Its hostname "
                f"{network.hostname(i)} resolves to 127.0.1.1 (loopback)") \
            in network.output(proc)


# What a stranger in another namespace tries against the head: read the hub's address from
# the (unauthenticated) rendezvous store, connect, and send pickles that would create the
# canary file if anything unpickled them, in place of the token's proof and as frames after.
STRANGER = """
import pickle, socket, struct, sys
from torch.distributed import TCPStore
endpoint, canary = sys.argv[1], sys.argv[2]
host, _, port = endpoint.rpartition(":")
store = TCPStore(host, int(port), is_master=False)
hub_host, _, hub_port = store.get("elastic_magic/hub").decode().split()[-1].rpartition(":")
evil = pickle.dumps(
    type("P", (), {"__reduce__": lambda s: (exec, (f"open({canary!r}, 'w').write('x')",))})())
sock = socket.create_connection((hub_host, int(hub_port)), timeout=30)
challenge = sock.recv(32)
try:
    for _ in range(3):
        sock.sendall(evil + struct.pack("!Q", len(evil)) + bytes(32) + evil)
except OSError:
    pass
received = b""
while True:
    try:
        chunk = sock.recv(1024)
    except OSError:
        break
    if not chunk:
        break
    received += chunk
print(f"challenge {len(challenge)} bytes, then {len(received)} bytes, then closed", flush=True)
"""


def test_a_machine_joins_mid_run_and_strangers_from_another_namespace_are_refused(
        baseline, network, log_dir, recorder, tmp_path):
    spec = em.JobSpec.create(2, nnodes="1:2", rdzv_endpoint=network.head_address,
                             log_dir=log_dir, timeout=60)
    canary = tmp_path / "canary"
    joined = tmp_path / "joined"  # step 30 waits for it: the job cannot end before the join
    procs = {}

    def drive(job):
        try:
            job.wait_for_commit(2, timeout=120)
            endpoint = recorder.of(AcceptingNodes)[0].endpoint
            # Machine 3 has no token, or the wrong one; machine 1 is invited.
            procs["stranger"] = network.popen(3, [sys.executable, "-c", STRANGER, endpoint,
                                                  str(canary)])
            procs["wrong"] = network.join(3, endpoint, "0" * 32)
            procs["machine"] = network.join(1, endpoint, job.token)
            job._board.wait_for(lambda s: s.nnodes == 2, timeout=120)
        finally:
            joined.touch()

    # Slow steps until it arrives (starts Python, imports torch): it joins mid-training.
    result = run_head(spec, TRAIN_UNTIL_JOINED, recorder, drive=drive, namespace={
        "KILL_AT": -1, "PAUSE": 0.4, "HOLDS": {30: str(joined)}})
    outputs = {name: network.output(proc) for name, proc in procs.items()}
    assert result.ok, (result, outputs)
    assert {name: proc.wait(timeout=30) for name, proc in procs.items()} == {
        "stranger": 0, "wrong": 1, "machine": 0}, outputs
    # The machine regrouped the job at a commit: no step lost or repeated, same parameters.
    assert [(r.world_size, r.nnodes) for r in recorder.of(RendezvousCompleted)] == [
        (2, 1), (3, 2)]
    assert result.restarts == 0
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)
    # The strangers: refused at the handshake, nothing unpickled, nothing started.
    assert "challenge 32 bytes, then 0 bytes, then closed" in outputs["stranger"]
    assert not canary.exists()
    assert "refused the token" in outputs["wrong"]
    assert not (tmp_path / "machine3-logs").exists()
    assert {e.peer for e in recorder.of(NodeConnected)} == {network.address(1)}


@pytest.mark.parametrize("how", ["killed", "cut"])
def test_a_machine_killed_or_cut_off_mid_training_leaves_the_others_to_finish(
        baseline, network, log_dir, recorder, how):
    """Three machines train; machine 1's agent is SIGKILLed, or its link goes down (packets
    dropped, nothing closed). The head names it, takes it out of the rendezvous and regroups
    the head and machine 2 from the last commit without a restart (they have none); a cut-off
    machine 1 notices the lost head within the link timeout, stops its workers and exits."""
    spec = em.JobSpec.create(1, nnodes="2:3", rdzv_endpoint=network.head_address,
                             log_dir=log_dir, timeout=60, link_timeout=3)
    joined = {}

    def on_open(job, endpoint):
        joined.update({i: network.join(i, endpoint, job.token) for i in (1, 2)})

    def drive(job):
        while not any(r.world_size == 3 for r in recorder.of(RendezvousCompleted)):
            if job.done:
                return  # they never all joined: the assertions below say so
            time.sleep(0.05)
        first_shared = job.last_commit["step"] if job.last_commit else 0
        job.wait_for_commit(first_shared + 3, timeout=120)
        if how == "killed":
            joined[1].send_signal(signal.SIGKILL)  # ours, by PID (its workers die with it)
        else:
            network.cut(1)

    result = run_head(spec, TRAIN, recorder, namespace={"KILL_AT": -1, "PAUSE": 0.2},
                      on_open=on_open, drive=drive)
    outputs = {i: network.output(proc) for i, proc in joined.items()}
    assert result.ok, (result, outputs)
    assert result.restarts == 0 and result.failures == []
    (lost,) = recorder.of(Excluded)
    assert lost.what.startswith(f"machine {network.address(1)} (node ") and lost.goes_on
    assert ("closed without notice" if how == "killed" else "no heartbeat for 3s") in lost.why
    assert result.excluded == [f"{lost.what}: {lost.why}"]
    assert [r.world_size for r in recorder.of(RendezvousCompleted)][-1] == 2
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)
    assert joined[2].wait(timeout=30) == 0, outputs[2]  # regrouped, not failed
    assert "restarting" not in outputs[2] and "failed" not in outputs[2], outputs[2]
    rc = joined[1].wait(timeout=60)
    if how == "killed":
        assert rc == -signal.SIGKILL
    else:
        assert rc == 1, outputs[1]
        output = network.output(joined[1])
        assert "elastic-magic join: lost the head at" in output and "no heartbeat for 3s" \
            in output, output


# A standalone job in a machine whose hostname resolves to its own address (as on many
# servers): without an interface named, gloo listens there and other machines reach it.
STANDALONE = """
import json, sys
import elastic_magic as em
cell, log_dir = sys.argv[1], sys.argv[2]
found = {}
for name, env in (("default", []), ("user's", ["GLOO_SOCKET_IFNAME=eth0"])):
    found[name] = em.launch(cell, nproc=3, env=env, log_dir=log_dir,
                            render=lambda events: None).values
print(json.dumps(found), flush=True)
"""
# Every TCP socket of the machine (its own network namespace) while the group is up: the
# agent's stores and every rank's gloo connections and listeners.
SOCKETS = """
import os, socket
import psutil
import torch, torch.distributed as dist
dist.all_reduce(torch.ones(1))
dist.barrier()
sockets = {(c.laddr.ip, c.status) for c in psutil.net_connections("tcp")}
dist.barrier()  # no rank leaves while another looks
dict(sockets=sorted(sockets), hostname_address=socket.gethostbyname(socket.gethostname()),
     master=os.environ["MASTER_ADDR"], gloo=os.environ.get("GLOO_SOCKET_IFNAME"),
     nccl=os.environ.get("NCCL_SOCKET_IFNAME"))
"""


def test_a_standalone_jobs_process_groups_stay_on_loopback(tmp_path, monkeypatch):
    """Its ranks listen and connect on loopback only, unless the user names an interface."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    with network_of(1, tmp_path, hostnames="own") as net:
        proc = net.popen(1, [sys.executable, "-c", STANDALONE, SOCKETS, str(tmp_path / "logs")])
        assert proc.wait(timeout=240) == 0, net.output(proc)
        found = json.loads(net.output(proc).splitlines()[-1])
    own = net.address(1)
    assert sorted(found["default"]) == sorted(found["user's"]) == ["0", "1", "2"]
    for seen in found["default"].values():
        assert seen["hostname_address"] == own  # gloo's pick, without an interface named
        assert seen["sockets"] and all(is_loopback(ip) for ip, _ in seen["sockets"]), seen
        assert seen["master"] == "127.0.0.1"
        assert (seen["gloo"], seen["nccl"]) == ("lo", "lo")
    for seen in found["user's"].values():  # the user's setting wins
        assert (seen["gloo"], seen["nccl"]) == ("eth0", "lo")
        assert [own, "LISTEN"] in seen["sockets"], seen
