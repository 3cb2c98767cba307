"""Emulated cluster: M hosts as network namespaces on one machine, shaped links, every method to one target.

    sudo python benchmarks/emulated_cluster.py --hosts 2 --ranks-per-host 2 --bandwidths 100mbit,1gbit \
        --methods dense,topk,pactrain,prunex-flat,prunex --target 0.90 --out runs/cluster [--latency 0ms] \
        [--max-minutes 40] [--run-timeout 600] [--racks 2 --spine-bandwidth 100mbit --spine-latency 0ms]
    sudo python benchmarks/emulated_cluster.py --cleanup        # remove what an interrupted run left behind

PacTrain's testbed methodology made real on one box. The script builds

* ``pxh0 … pxh{M-1}``: one network namespace per host, each with one interface ``eth0`` (10.77.0.{k+1}/24)
  and ``lo``; the ranks of host k run inside it, in their own UTS namespace whose host name is ``pxhk``;
* ``pxhsw``: the switch, a namespace holding the Linux bridge ``br0`` and the other end of every host's veth;
* ``pxhrun``: the launcher's namespace (10.77.0.254/24, unshaped link), where ``mpirun`` runs.

All addresses live inside these namespaces; the root namespace gets no address, no route, no device. Each
host link is shaped in both directions with ``tc`` (tbf at the given rate on the host's ``eth0`` = its
egress, and on its switch port = its ingress; ``--latency D`` adds a netem delay of D/2 at each of the two,
so D is the one-way host-to-host latency). Jumbo frames (``--mtu 9000``) and GSO capped at the MTU, so that
the kernel's counters count the frames a physical NIC would put on the wire.

Racks (``--racks R``, R > 1; ``--hosts`` must be a multiple of R): host k is in rack k // (M/R). Instead of
``pxhsw`` there is one switch per rack, ``pxhsw0 … pxhsw{R-1}`` (each its own bridge ``br0``; host k's port
``hk`` is on its rack's switch), and ``pxhspine``, the spine switch (a bridge ``br0`` and nothing else). Each rack
switch's port ``uplink`` is a veth to the spine's port ``rack{r}``: one flat L2 segment and subnet, no address on
a switch. Every spine link is shaped like a host link, in both directions (tbf at ``--spine-bandwidth``, default
the run's host bandwidth, on ``uplink`` = the rack's egress and on ``rack{r}`` = its ingress; netem delay
``--spine-latency``/2 at each, so a frame between two racks gains ``--spine-latency`` one way: it leaves over
its rack's uplink and enters over the other's). ``pxhrun`` is on rack 0's switch (port ``run``, unshaped), so
its control traffic with racks 1.. crosses the spine: an htb qdisc on both ends of its link counts it per rack
(one class per rack at 100 Gbit/s, a counter rather than a limit; u32 filters by host address). Every job gets
``--nodes-per-rack M/R`` first in its train arguments (a method's own ``--nodes-per-rack`` wins), so the
library's topology knows the racks. ``--racks 1`` (the default) is the build above, unchanged.

Ranks are launched by ``mpirun -H pxh0:P,pxh1:P,…`` with ``benchmarks/cluster/nsrsh`` as rsh agent (it runs
the ``orted`` of host k inside ``pxhk``): Open MPI and Horovod see M real hosts, so node grouping comes from
the hosts themselves (``PRUNEX_RANKS_PER_NODE`` is not set), ranks of a host talk over shared memory and
ranks of different hosts over TCP through the shaped links.

Every method runs ``prunex-hvd train`` with the same knobs, plus its own ``--method-args METHOD=ARGS`` if given
(e.g. the linear-scaling lr of a local-SGD method). Per (bandwidth, method) the JSON record has the
wall time to target (``wall_s`` of the first ``metrics.jsonl`` round whose ``test_acc`` ≥ target; the
trainer's ``wall_s`` excludes evaluation and checkpoint time), the final accuracy, the library's own
``inter_bytes`` (ring model, whole job) and what the kernel counted: ``kernel_inter_bytes`` = Σ over hosts
of ``tx_bytes`` of ``eth0`` inside the host's namespace (every frame a host sent), minus ``rx_bytes`` of the
launcher's ``eth0`` (the frames hosts sent to mpirun rather than to another host), read from
``/sys/class/net/eth0/statistics`` before and after the job (start-up, evaluation and shutdown included).
``kernel_inter_bytes_switch`` is the same figure counted at the other end of the wire (Σ ``tx_bytes`` of the
switch ports toward the hosts minus the launcher's ``tx_bytes``): the two agree up to broadcast frames.
``kernel_inter_payload_bytes_est`` subtracts 66 bytes of Ethernet/IPv4/TCP headers per counted frame (ACKs
included). Two library figures sit next to them: ``library_inter_bytes`` (``metrics.jsonl``: the method's
training traffic) and ``library_ledger_cross_node_bytes`` (every collective the accounting layer saw,
including the initial model broadcast and evaluation bookkeeping; written by ``cluster/train_entry.py``
into ``ledger.json``). A job stopped by ``--run-timeout`` still reports its time to target if it got there;
``--stop-at-target`` stops each job as soon as a round reaches the target (status ``stopped-at-target``).
With racks a record adds ``kernel_spine_bytes``: Σ over racks of ``tx_bytes`` of the rack switch's ``uplink``
(the frames that left a rack for another: both directions of every rack pair, each frame once), minus the
launcher's frames with racks 1.. (the htb counters; its ARP broadcasts stay in, a few hundred bytes);
``kernel_spine_bytes_spine_side`` the same counted where the frames enter a rack (Σ ``tx_bytes`` of the spine's
``rack{r}``); ``kernel_spine_launcher_bytes`` what was taken out; ``kernel_spine_bytes_by_link`` per uplink
``{out_bytes, in_bytes}`` (leaving / entering that rack, launcher taken out); ``library_ledger_cross_rack_bytes``
(Σ over ranks of the ledger's ``total.cross_rack_bytes``: bytes whose ring successor is in another rack) with
``library_ledger_cross_rack_by_op`` and ``kernel_spine_over_ledger_cross_rack``. The document's ``cluster`` then
records ``racks``, ``hosts_per_rack``, ``rack_of_host``, ``spine_bandwidth`` and ``spine_shaping`` (per host
bandwidth), ``spine_latency_one_way_ms``, and ``spine_check_mbit``: one TCP stream's goodput pxh0 → the first host
of rack 1 (``link_check_mbit`` stays pxh0 → pxh1, within rack 0; ``null`` with one host per rack).

Open MPI's ``tuned`` collectives are forced to the ring algorithms (``--collectives ring``, the default) so
that the wire carries what the library's ring model accounts; ``--collectives default`` leaves Open MPI's
own choice (for 4 ranks and ~0.3 MB it picks reduce+broadcast, which moves 2B across the cut where the ring
moves 3B). ``dense`` runs Horovod's own DistributedOptimizer; the other methods send no tensor through
Horovod, and by default (``--control-plane auto``) run without it, so that Horovod's background negotiation
does not add unaccounted bytes (``--control-plane horovod`` starts Horovod in every job, the library's
default under mpirun). ``METHOD@mpi`` / ``METHOD@horovod`` in ``--methods`` pins one job's control plane:
``dense@mpi`` is dense data parallelism without Horovod (the library's bucketed ring allreduce over mpi4py).
``METHOD+LABEL`` is one more job of METHOD under its own name, with its own ``--method-args METHOD+LABEL=ARGS``
(``prunex+nosync``): the summary gives every PruneX job's speed-up against the fastest round-based rival
(local SGD, hierarchical local SGD, DiLoCo) that reached the target.

Needs root, ``ip`` (iproute2), ``tc``, ``unshare`` (util-linux) and Open MPI's ``mpirun``. Prints the JSON
document to stdout and writes it to ``<out>/emulated_cluster.json``; per-run logs and training outputs are in
``<out>/<bandwidth>/<method>[.log]`` (a previous run's directory of the same name is replaced).
Everything is torn down on exit, on failure, on Ctrl-C and on SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
AGENT = os.path.join(HERE, "cluster", "nsrsh")
ENTRY = os.path.join(HERE, "cluster", "train_entry.py")

SUBNET = "10.77.0"
SWITCH_NS = "pxhsw"
SPINE_NS = "pxhspine"
LAUNCH_NS = "pxhrun"
NETNS_ETC = "/etc/netns"                # per-namespace /etc files (hosts)
HOST_RE = re.compile(r"^pxh\d+$")
RACK_SWITCH_RE = re.compile(r"^pxhsw\d+$")   # pxhsw0, pxhsw1, ...: one switch per rack with --racks > 1
ALL_METHODS = ("dense", "topk", "pactrain", "localsgd", "localsgd-hier", "diloco", "prunex-flat", "prunex")
HOROVOD_METHODS = {"dense"}            # methods whose tensors go through Horovod itself
HEADER_BYTES = 66                      # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12, per frame

DEFAULT_TRAIN_ARGS = ("--model resnet_small --dataset digits --image-size 16 --epochs 10 --batch-size 16 "
                      "--lr 0.05 --sparsity channel:0.5 --rho1 0.05 --rho2 0.05 --local-steps 11 "
                      "--freeze-round 4 --topk-ratio 0.01 --threads 1 --checkpoint-every 0")
RING_MCA = {"coll_tuned_use_dynamic_rules": "1", "coll_tuned_allreduce_algorithm": "4",
            "coll_tuned_allgather_algorithm": "4", "coll_tuned_allgatherv_algorithm": "3",
            "coll_tuned_bcast_algorithm": "2", "coll_tuned_bcast_algorithm_chain_fanout": "1"}


class Interrupted(Exception):
    pass


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(*cmd: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, text=True,
                          stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                          stderr=subprocess.PIPE)


def parse_rate(text: str) -> float:
    """'100mbit' → bits per second (tc's units: bit, kbit, mbit, gbit)."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kmg]?)bit", text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bad bandwidth {text!r}: use e.g. 100mbit, 1gbit, 500kbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def parse_ms(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|us|s)?\s*", text.lower())
    if not m:
        raise ValueError(f"bad latency {text!r}: use e.g. 0ms, 2ms, 500us")
    return float(m.group(1)) * {"ms": 1.0, "us": 1e-3, "s": 1e3, None: 1.0}[m.group(2)]


# ---------------------------------------------------------------- preflight, cleanup

def preflight() -> Optional[str]:
    if os.geteuid() != 0:
        return "must run as root (it creates network namespaces, veth links, a bridge and tc qdiscs)"
    missing = [t for t in ("ip", "tc", "bridge", "unshare", "mpirun") if shutil.which(t) is None]
    if missing:
        return (f"missing tool(s): {', '.join(missing)} (need iproute2's ip, tc and bridge, util-linux's unshare "
                "and Open MPI's mpirun)")
    if not os.access(AGENT, os.X_OK):
        return f"the rsh agent {AGENT} is missing or not executable"
    r = sh("ip", "netns", "list", check=False, capture=True)
    if r.returncode:
        return f"'ip netns' does not work here: {r.stderr.strip()}"
    return None


def is_switch(name: str) -> bool:
    return name in (SWITCH_NS, SPINE_NS) or bool(RACK_SWITCH_RE.match(name))


def our_namespaces() -> List[str]:
    r = sh("ip", "netns", "list", check=False, capture=True)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if HOST_RE.match(n) or is_switch(n) or n == LAUNCH_NS]


def kill_namespace_processes(names: List[str]) -> int:
    """SIGKILL every process still running inside our namespaces (all of them were started by us)."""
    killed = 0
    for _ in range(3):
        pids = set()
        for ns in names:
            r = sh("ip", "netns", "pids", ns, check=False, capture=True)
            pids.update(int(p) for p in r.stdout.split() if p.isdigit())
        pids.discard(os.getpid())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    return killed


def become_subreaper() -> None:
    """Orphans of killed jobs (an orted whose agent died first) are re-parented to us, not to PID 1."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def teardown() -> List[str]:
    for ns in os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else ():
        if HOST_RE.match(ns) or ns == LAUNCH_NS:
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
    names = our_namespaces()
    if not names:
        return []
    kill_namespace_processes(names)
    # the switches first: deleting one removes its bridge and the switch end of every veth (and so its peer)
    for ns in sorted(names, key=lambda n: not is_switch(n)):
        sh("ip", "netns", "delete", ns, check=False)
    left = our_namespaces()
    if left:
        log(f"warning: namespaces still present after teardown: {left}")
    return names


# ---------------------------------------------------------------- build and shape

def horovodrun_in_cluster(work_dir: str, hosts: List[str]) -> Tuple[List[str], List[str], Dict[str, str]]:
    """How ``horovodrun`` runs on this cluster: in the launcher's namespace, on the hosts' ``eth0``, reaching
    ``hosts`` through the rsh agent as its ``ssh`` (a folder in ``work_dir`` holding an ``ssh`` that calls it,
    first on PATH). Returns the command prefix, horovodrun's own arguments and the environment to add."""
    shim = os.path.join(work_dir, "ssh-shim")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "ssh"), "w") as f:
        f.write(f'#!/bin/sh\nexec {AGENT} "$@"\n')
    os.chmod(os.path.join(shim, "ssh"), 0o755)
    return (["ip", "netns", "exec", LAUNCH_NS], ["--network-interface", "eth0"],
            {"PXC_HOSTS": " ".join(hosts), "PATH": f"{shim}:{os.environ.get('PATH', '')}"})


def torchrun_on_host(host: int) -> Tuple[List[str], List[str], Dict[str, str]]:
    """How a ``torchrun`` agent runs on host ``pxh{host}``: inside its namespace, announcing its own address to the
    rendezvous (the machine's host name resolves to none of ours) and Gloo on ``eth0``. Returns the command
    prefix, torchrun's own arguments and the environment to add."""
    return (["ip", "netns", "exec", f"pxh{host}"], ["--local-addr", f"{SUBNET}.{host + 1}"],
            {"GLOO_SOCKET_IFNAME": "eth0"})


def set_link(host: int, up: bool, hosts: int, racks: int = 1) -> None:
    """Stall host ``host``'s link (``up=False``: its switch port drops every frame, both ways, and neither end
    sees an error, as when a cable or a switch dies) or bring it back."""
    switch = host_switches(hosts, racks)[host]
    in_ns(switch, "bridge", "link", "set", "dev", f"h{host}", "state", "3" if up else "0")


def in_ns(ns: str, *cmd: str, **kw) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", ns, *cmd, **kw)


def rack_of_hosts(hosts: int, racks: int) -> List[int]:
    """Rack of every host: host k is in rack k // (hosts / racks)."""
    if racks < 1 or hosts % racks:
        raise ValueError(f"--racks {racks}: the {hosts} hosts do not split into {racks} racks of equal size "
                         f"(--hosts must be a multiple of --racks)")
    per_rack = hosts // racks
    return [k // per_rack for k in range(hosts)]


def switch_names(racks: int) -> List[str]:
    return [SWITCH_NS] if racks == 1 else [f"{SWITCH_NS}{r}" for r in range(racks)]


def host_switches(hosts: int, racks: int) -> List[str]:
    """The switch namespace every host is attached to."""
    switches = switch_names(racks)
    return [switches[r] for r in rack_of_hosts(hosts, racks)]


def build(hosts: int, mtu: int, racks: int = 1) -> None:
    host_names = [f"pxh{k}" for k in range(hosts)]
    switches = switch_names(racks)
    bridges = switches + ([SPINE_NS] if racks > 1 else [])
    # every host name resolves inside the cluster (``ip netns exec`` mounts /etc/netns/NS/hosts over /etc/hosts):
    # horovodrun's workers find each other by host name
    names = "".join(f"{SUBNET}.{k + 1} {n}\n" for k, n in enumerate(host_names)) + f"{SUBNET}.254 {LAUNCH_NS}\n"
    for ns in (LAUNCH_NS, *host_names):
        os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
        with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n" + names)
    for ns in (*bridges, LAUNCH_NS, *host_names):
        sh("ip", "netns", "add", ns)
        # no IPv6: no router solicitations, DAD or MLD reports on the counted links
        in_ns(ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                              "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6", check=False)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    for sw in bridges:
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        sh("ip", "-n", sw, "link", "set", "br0", "mtu", str(mtu))
    ends = [(sw, ns, f"h{k}", f"{SUBNET}.{k + 1}")
            for k, (ns, sw) in enumerate(zip(host_names, host_switches(hosts, racks)))]
    ends.append((switches[0], LAUNCH_NS, "run", f"{SUBNET}.254"))
    for sw, ns, port, addr in ends:
        sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        for where, dev in ((sw, port), (ns, "eth0")):
            sh("ip", "-n", where, "link", "set", dev, "mtu", str(mtu), "gso_max_size", str(mtu))
        sh("ip", "-n", sw, "link", "set", port, "master", "br0")
        sh("ip", "-n", sw, "link", "set", port, "up")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
    # spine links: rack r's switch port "uplink" to the spine's port "rack{r}", pure L2 (one subnet, no address)
    for r, sw in enumerate(switches if racks > 1 else []):
        sh("ip", "-n", sw, "link", "add", "uplink", "type", "veth", "peer", "name", f"rack{r}", "netns", SPINE_NS)
        for where, dev in ((sw, "uplink"), (SPINE_NS, f"rack{r}")):
            sh("ip", "-n", where, "link", "set", dev, "mtu", str(mtu), "gso_max_size", str(mtu))
            sh("ip", "-n", where, "link", "set", dev, "master", "br0")
            sh("ip", "-n", where, "link", "set", dev, "up")
    for sw in bridges:
        sh("ip", "-n", sw, "link", "set", "br0", "up")
    if racks > 1:
        count_launcher_by_rack(hosts, racks)


def count_launcher_by_rack(hosts: int, racks: int) -> None:
    """The launcher sits in rack 0, so its control traffic with hosts of other racks crosses the spine: count it
    per rack, to subtract it. An HTB qdisc on both ends of the launcher's (unshaped) link, one class per rack at
    100 Gbit/s (a counter, not a limit), u32 filters by host address; other frames (ARP) bypass the classes."""
    rack = rack_of_hosts(hosts, racks)
    for ns, dev, field in ((LAUNCH_NS, "eth0", "dst"), (switch_names(racks)[0], "run", "src")):
        cmds = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"]]
        cmds += [["class", "add", "dev", dev, "parent", "1:", "classid", f"1:{r + 1:x}", "htb", "rate", "100gbit",
                  "burst", "1mb", "cburst", "1mb", "quantum", "60000"] for r in range(racks)]
        cmds += [["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
                  field, f"{SUBNET}.{k + 1}/32", "flowid", f"1:{rack[k] + 1:x}"] for k in range(hosts)]
        for cmd in cmds:
            r = sh("tc", "-n", ns, *cmd, check=False)
            if r.returncode:
                raise RuntimeError(f"--racks counts the launcher's traffic per rack with tc's htb qdisc and u32 "
                                   f"filter, which this kernel refuses (tc {' '.join(cmd)}: {r.stderr.strip()})")


def parse_htb_bytes(text: str) -> Dict[int, int]:
    """``tc -s class show`` of :func:`count_launcher_by_rack`'s qdisc → {rack: bytes sent}."""
    return {int(m.group(1), 16) - 1: int(m.group(2))
            for m in re.finditer(r"class htb 1:([0-9a-f]+) .*?Sent (\d+) bytes", text, re.S)}


def shape_dev(ns: str, dev: str, rate_bps: float, latency_ms: float, mtu: int, flag: str = "--latency") -> str:
    """tbf at ``rate`` on the egress of one device, netem delay ``latency_ms`` under it; returns the command."""
    burst = max(16 * 1024, 2 * (mtu + 14), int(rate_bps / 8 * 1e-3))   # ≥ 1 ms of line rate
    sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
    tbf = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{int(rate_bps)}bit",
           "burst", str(burst), "latency", "100ms"]
    sh(*tbf)
    if latency_ms > 0:
        r = sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
               "delay", f"{latency_ms:g}ms", "limit", "100000", check=False)
        if r.returncode:
            raise RuntimeError(f"{flag} needs tc's netem qdisc, which this kernel refuses "
                               f"({r.stderr.strip()}; module sch_netem missing?): run with {flag} 0ms")
    return " ".join(tbf[3:]) + (f" + netem delay {latency_ms:g}ms" if latency_ms else "")


def shape(hosts: int, rate_bps: float, latency_ms: float, mtu: int, racks: int = 1) -> Dict[str, str]:
    """tbf at ``rate`` on both directions of every host link; netem delay latency/2 under each tbf."""
    cmds = {}
    for k, sw in enumerate(host_switches(hosts, racks)):
        for ns, dev in ((f"pxh{k}", "eth0"), (sw, f"h{k}")):
            cmds[f"{ns}/{dev}"] = shape_dev(ns, dev, rate_bps, latency_ms / 2, mtu)
    return cmds


def shape_spine(racks: int, rate_bps: float, latency_ms: float, mtu: int) -> Dict[str, str]:
    """The same on both directions of every spine link: a frame between two racks crosses two of them (its rack's
    uplink, then the other rack's downlink), so latency/2 on each is ``latency`` rack to rack."""
    cmds = {}
    for r, sw in enumerate(switch_names(racks)):
        for ns, dev in ((sw, "uplink"), (SPINE_NS, f"rack{r}")):
            cmds[f"{ns}/{dev}"] = shape_dev(ns, dev, rate_bps, latency_ms / 2, mtu, flag="--spine-latency")
    return cmds


_TPUT = r"""
import socket, sys, time
if sys.argv[1] == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[2], 5999)); s.listen(1); s.settimeout(20)
    c, _ = s.accept(); c.settimeout(20); n, t0 = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        if t0 is None: t0 = time.perf_counter()
        else: n += len(b)
    print(n * 8 / (time.perf_counter() - t0) / 1e6)
else:
    for _ in range(100):
        try: c = socket.create_connection((sys.argv[2], 5999)); break
        except OSError: time.sleep(0.05)
    buf, end = b"x" * (1 << 18), time.perf_counter() + float(sys.argv[3])
    while time.perf_counter() < end: c.sendall(buf)
    c.close()
"""


def link_check(seconds: float = 2.0, src: int = 0, dst: int = 1) -> Optional[float]:
    """TCP goodput pxh{src} → pxh{dst} in Mbit/s (one stream), to confirm the shaping."""
    addr = f"{SUBNET}.{dst + 1}"
    server = subprocess.Popen(["ip", "netns", "exec", f"pxh{dst}", sys.executable, "-c", _TPUT, "server",
                               addr], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        in_ns(f"pxh{src}", sys.executable, "-c", _TPUT, "client", addr, str(seconds), check=False)
        out, _ = server.communicate(timeout=30)
        return round(float(out.strip()), 1)
    except (subprocess.TimeoutExpired, ValueError):
        server.kill()
        server.wait()
        return None


# ---------------------------------------------------------------- counters

def read_stats(ns: str, dev: str) -> Dict[str, int]:
    base = f"/sys/class/net/{dev}/statistics"
    keys = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")
    r = in_ns(ns, "cat", *(f"{base}/{k}" for k in keys), capture=True)
    return dict(zip(keys, map(int, r.stdout.split())))


def read_launcher_by_rack(ns: str, dev: str) -> Dict[int, int]:
    return parse_htb_bytes(sh("tc", "-n", ns, "-s", "class", "show", "dev", dev, capture=True).stdout)


def snapshot(hosts: int, racks: int = 1) -> Dict[str, Dict[str, int]]:
    snap = {f"pxh{k}/eth0": read_stats(f"pxh{k}", "eth0") for k in range(hosts)}
    snap.update({f"{sw}/h{k}": read_stats(sw, f"h{k}") for k, sw in enumerate(host_switches(hosts, racks))})
    snap[f"{LAUNCH_NS}/eth0"] = read_stats(LAUNCH_NS, "eth0")
    if racks > 1:
        for r, sw in enumerate(switch_names(racks)):
            snap[f"{sw}/uplink"] = read_stats(sw, "uplink")
            snap[f"{SPINE_NS}/rack{r}"] = read_stats(SPINE_NS, f"rack{r}")
        to_rack = read_launcher_by_rack(LAUNCH_NS, "eth0")
        from_rack = read_launcher_by_rack(switch_names(racks)[0], "run")
        for r in range(racks):
            snap[f"launcher->rack{r}"] = {"tx_bytes": to_rack.get(r, 0)}
            snap[f"rack{r}->launcher"] = {"tx_bytes": from_rack.get(r, 0)}
    return snap


def kernel_traffic(before, after, hosts: int, racks: int = 1) -> Dict[str, object]:
    d = {k: {s: after[k][s] - before[k][s] for s in after[k]} for k in after}
    run = d[f"{LAUNCH_NS}/eth0"]
    host_tx = {f"pxh{k}": d[f"pxh{k}/eth0"]["tx_bytes"] for k in range(hosts)}
    inter = sum(host_tx.values()) - run["rx_bytes"]
    packets = sum(d[f"pxh{k}/eth0"]["tx_packets"] for k in range(hosts)) - run["rx_packets"]
    switch = sum(d[f"{sw}/h{k}"]["tx_bytes"] for k, sw in enumerate(host_switches(hosts, racks))) - run["tx_bytes"]
    out = {"kernel_inter_bytes": inter, "kernel_inter_packets": packets,
           "kernel_inter_payload_bytes_est": inter - HEADER_BYTES * packets,
           "kernel_inter_bytes_switch": switch, "kernel_tx_bytes_by_host": host_tx,
           "kernel_launcher_bytes": run["rx_bytes"] + run["tx_bytes"]}
    if racks > 1:
        out.update(spine_traffic(d, racks))
    return out


def spine_traffic(d: Dict[str, Dict[str, int]], racks: int) -> Dict[str, object]:
    """Bytes between racks from the counter deltas ``d``: rack r's out = ``tx_bytes`` of its switch's uplink, its
    in = ``tx_bytes`` of the spine's port toward it, each less the launcher's share. The launcher is in rack 0:
    its frames to rack r ≥ 1 leave over rack 0's uplink and enter over rack r's, and the replies the other way."""
    to_rack = [d[f"launcher->rack{r}"]["tx_bytes"] for r in range(racks)]
    from_rack = [d[f"rack{r}->launcher"]["tx_bytes"] for r in range(racks)]
    launcher_out = [sum(to_rack[1:])] + from_rack[1:]
    launcher_in = [sum(from_rack[1:])] + to_rack[1:]
    by_link = {}
    for r, sw in enumerate(switch_names(racks)):
        by_link[f"{sw}/uplink"] = {"out_bytes": d[f"{sw}/uplink"]["tx_bytes"] - launcher_out[r],
                                   "in_bytes": d[f"{SPINE_NS}/rack{r}"]["tx_bytes"] - launcher_in[r]}
    return {"kernel_spine_bytes": sum(v["out_bytes"] for v in by_link.values()),
            "kernel_spine_bytes_spine_side": sum(v["in_bytes"] for v in by_link.values()),
            "kernel_spine_launcher_bytes": sum(to_rack[1:]) + sum(from_rack[1:]),
            "kernel_spine_bytes_by_link": by_link}


# ---------------------------------------------------------------- one job

def mpirun_command(hosts: int, per_host: int, mca: Dict[str, str], train_argv: List[str]) -> List[str]:
    cmd = ["ip", "netns", "exec", LAUNCH_NS, "mpirun", "-np", str(hosts * per_host),
           "-H", ",".join(f"pxh{k}:{per_host}" for k in range(hosts)), "--bind-to", "none",
           "-x", "PXC_CONTROL_PLANE", "-x", "PRUNEX_MASTER_ADDR", "-x", "GLOO_SOCKET_IFNAME"]
    for key, value in mca.items():
        cmd += ["--mca", key, value]
    return cmd + [sys.executable, ENTRY, "train", *train_argv]


def job_argv(args, method: str, out_dir: str) -> List[str]:
    name = parse_method(method)[0]
    # with racks the library's topology learns them (its ledger then counts cross_rack_bytes); first, so that a
    # method's own --nodes-per-rack still wins (later flags win in argparse, as a method's own args over the
    # shared ones)
    racks = ["--nodes-per-rack", str(args.hosts // args.racks)] if args.racks > 1 else []
    # the shared args without the flags that do not apply to this method (train refuses them)
    from prunex_hvd.app.cli import flags_for_method
    return racks + flags_for_method(name, args.train_args.split()) \
        + args.method_args.get(method, args.method_args.get(name, "")).split() + ["--method", name, "--out", out_dir]


def kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_metrics(out_dir: str, target: float, racks: int = 1) -> Dict[str, object]:
    res = {"time_to_target_s": None, "round_at_target": None, "epoch_at_target": None, "final_test_acc": None,
           "library_inter_bytes": None, "train_wall_s": None, "num_nodes": None, "ranks_per_node": None,
           "topology_grouping": None, "launcher": None, "rounds": None}
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return res
    last = last_round = at_freeze = None
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            last = rec
            if rec.get("event") == "round" and rec.get("exchange_wait_s") is not None:
                last_round = rec
                if at_freeze is None and rec.get("frozen"):
                    at_freeze = rec   # the round that froze the masks: the rounds after it may be overlapped
            if rec.get("event") == "round" and res["time_to_target_s"] is None \
                    and rec.get("test_acc") is not None and rec["test_acc"] >= target:
                res.update(time_to_target_s=round(rec["wall_s"], 2), round_at_target=rec["round"],
                           epoch_at_target=round(rec["epoch"], 2))
    if last is not None:
        res.update(library_inter_bytes=last.get("inter_bytes"), train_wall_s=round(last["wall_s"], 2),
                   final_test_acc=last.get("test_acc"), rounds=last.get("round"))
        if at_freeze is not None and last_round["round"] > at_freeze["round"]:   # rank 0's wait a round after it
            res["frozen_exchange_wait_per_round_s"] = round(
                (last_round["exchange_wait_s"] - at_freeze["exchange_wait_s"])
                / (last_round["round"] - at_freeze["round"]), 4)
    try:
        with open(os.path.join(out_dir, "summary.json")) as f:
            s = json.load(f)
        res.update(final_test_acc=s["final_test_acc"], library_inter_bytes=s["inter_bytes"],
                   num_nodes=s["num_nodes"], ranks_per_node=s["ranks_per_node"], density=s.get("density"))
        if s.get("exchange_wait_s") is not None:   # PruneX: rank 0 (a leader) waiting on the consensus exchange
            res.update(exchange_wait_s=round(s["exchange_wait_s"], 3),
                       exchange_wait_per_round_s=round(s["exchange_wait_s"] / max(1, s["rounds"]), 4))
    except (OSError, ValueError, KeyError):
        pass
    led = None
    try:
        with open(os.path.join(out_dir, "ledger.json")) as f:
            led = json.load(f)
        res["library_ledger_cross_node_bytes"] = led["cross_node_bytes"]
        res["library_ledger_by_op"] = {k: v["cross_node_bytes"] for k, v in led["by_tier_op"].items()
                                       if v["cross_node_bytes"]}
    except (OSError, ValueError, KeyError):
        res["library_ledger_cross_node_bytes"] = None
    if racks > 1:   # every rank's ring successor in another rack, as the topology (--nodes-per-rack) sees racks
        try:
            res["library_ledger_cross_rack_bytes"] = sum(r["total"]["cross_rack_bytes"] for r in led["ranks"])
            res["library_ledger_cross_rack_by_op"] = {k: v["cross_rack_bytes"] for k, v in led["by_tier_op"].items()
                                                      if v.get("cross_rack_bytes")}
        except (TypeError, KeyError):   # no ledger (a failed job), or one from before racks
            res["library_ledger_cross_rack_bytes"] = None
    try:
        with open(os.path.join(out_dir, "config.json")) as f:
            c = json.load(f)
        res.update(topology_grouping=c.get("topology_grouping"), launcher=c.get("launcher"))
    except (OSError, ValueError):
        pass
    return res


class TargetReached(Exception):
    """The job's metrics show the target: with ``--stop-at-target`` the rest of its run is not needed."""


def wait_for_job(proc: subprocess.Popen, timeout_s: float, out_dir: str, target: Optional[float]) -> int:
    """``proc``'s exit code; TimeoutExpired after ``timeout_s``; with a ``target``, TargetReached as soon as a
    round of ``metrics.jsonl`` has reached it (polled every second)."""
    if target is None:
        return proc.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if read_metrics(out_dir, target)["time_to_target_s"] is not None:
                raise TargetReached() from None
            if time.monotonic() >= deadline:
                raise


def run_one(args, bw: str, method: str, mca: Dict[str, str], timeout_s: float) -> Dict[str, object]:
    bw_dir = os.path.join(args.out, bw)
    out_dir = os.path.join(bw_dir, method)
    os.makedirs(bw_dir, exist_ok=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    name, forced = parse_method(method)              # "dense@mpi": this method under that control plane
    control = forced or ("horovod" if args.control_plane == "horovod" or (
        args.control_plane == "auto" and name in HOROVOD_METHODS) else "mpi")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRUNEX_RANKS_PER_NODE", "OMPI_MCA_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PXC_CONTROL_PLANE=control,
               PXC_HOSTS=" ".join(f"pxh{k}" for k in range(args.hosts)), PYTHONUNBUFFERED="1",
               # torch.distributed (the round-based rivals' averaging): rank 0 sits on pxh0, and gloo talks
               # on the host's one interface (the host names resolve to nothing inside the namespaces)
               PRUNEX_MASTER_ADDR=f"{SUBNET}.1", GLOO_SOCKET_IFNAME="eth0")
    cmd = mpirun_command(args.hosts, args.ranks_per_host, mca, job_argv(args, method, out_dir))
    log(f"{bw} {method}: start (timeout {timeout_s:.0f} s, control plane {control})")
    before = snapshot(args.hosts, args.racks)
    load0 = os.getloadavg()[0]   # other work on the host skews wall times: record the load
    t0 = time.perf_counter()
    status, rc = "ok", None
    with open(out_dir + ".log", "w") as logf:
        logf.write(" ".join(cmd) + "\n\n")
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            rc = wait_for_job(proc, timeout_s, out_dir, args.target if args.stop_at_target else None)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
            kill_group(proc)
            rc = proc.returncode
        except TargetReached:
            status = "stopped-at-target"
            kill_group(proc)
            rc = proc.returncode
        except BaseException:
            kill_group(proc)
            kill_namespace_processes([f"pxh{k}" for k in range(args.hosts)] + [LAUNCH_NS])
            raise
    kill_namespace_processes([f"pxh{k}" for k in range(args.hosts)] + [LAUNCH_NS])   # stragglers
    reap()
    job_s = time.perf_counter() - t0
    after = snapshot(args.hosts, args.racks)
    rec = {"bandwidth": bw, "method": method, "status": status, "rc": rc, "job_wall_s": round(job_s, 1),
           "control_plane": control, "out": out_dir, "loadavg_1m_before_after": [load0, os.getloadavg()[0]]}
    rec.update(read_metrics(out_dir, args.target, args.racks))
    rec.update(kernel_traffic(before, after, args.hosts, args.racks))
    lib = rec.get("library_inter_bytes")
    led = rec.get("library_ledger_cross_node_bytes")
    for label, num in (("kernel", rec["kernel_inter_bytes"]), ("payload_est", rec["kernel_inter_payload_bytes_est"])):
        rec[f"{label}_over_library"] = round(num / lib, 4) if lib else None
        rec[f"{label}_over_ledger"] = round(num / led, 4) if led else None
    log(f"{bw} {method}: {status} in {job_s:.0f} s; to target {rec['time_to_target_s']} s, "
        f"final acc {rec['final_test_acc']}, kernel {rec['kernel_inter_bytes']} B vs library {lib} B "
        f"(x{rec['kernel_over_library']}), ledger {led} B (x{rec['kernel_over_ledger']}, "
        f"payload est x{rec['payload_est_over_ledger']})")
    if args.racks > 1:
        cross = rec.get("library_ledger_cross_rack_bytes")
        rec["kernel_spine_over_ledger_cross_rack"] = round(rec["kernel_spine_bytes"] / cross, 4) if cross else None
        log(f"{bw} {method}: spine {rec['kernel_spine_bytes']} B (launcher's {rec['kernel_spine_launcher_bytes']} B "
            f"taken out) vs ledger cross-rack {cross} B (x{rec['kernel_spine_over_ledger_cross_rack']})")
    return rec


# ---------------------------------------------------------------- main

ROUND_BASED_RIVALS = ("localsgd", "localsgd-hier", "diloco")


def parse_method(entry: str):
    """``NAME[+LABEL][@PLANE]`` → (NAME, PLANE or ""). ``prunex+plain`` is a second prunex job with its own
    ``--method-args prunex+plain=...`` (its own folder and row)."""
    head, _, plane = entry.partition("@")
    return head.partition("+")[0], plane


def rival_speedups(rows: Dict[str, dict]) -> Dict[str, object]:
    """Time to target of every prunex job against the fastest round-based rival that reached the target."""
    reached = {m: r["time_to_target_s"] for m, r in rows.items()
               if parse_method(m)[0] in ROUND_BASED_RIVALS and r.get("time_to_target_s")}
    if not reached:
        return {}
    best = min(reached, key=reached.get)
    out = {"best_round_based_rival": best, "best_rival_time_to_target_s": reached[best]}
    for m, r in rows.items():
        if parse_method(m)[0] == "prunex" and r.get("time_to_target_s"):
            out[f"{m}_speedup_vs_best_rival"] = round(reached[best] / r["time_to_target_s"], 2)
    return out


def overlaps(train_argv: List[str]) -> bool:
    """Whether `prunex-hvd train` arguments turn overlap on (``--overlap on|N``; the last one given counts)."""
    value = "off"
    for i, token in enumerate(train_argv):
        if token == "--overlap" and i + 1 < len(train_argv):
            value = train_argv[i + 1]
        elif token.startswith("--overlap="):
            value = token.split("=", 1)[1]
    return value.lower() not in ("off", "false", "no", "0")


def overlap_pairs(rows: Dict[str, dict], overlapped) -> Dict[str, object]:
    """Each overlapped job (in ``overlapped``: its arguments turn ``--overlap`` on) against its blocking twin, the
    same name without ``-overlap`` / ``+overlap``, else its method's plain job: exposed exchange time per round
    (rank 0, a leader, waiting on the inter-node exchange), time to target and training wall, as ratios; and the
    wait per round after the masks froze alone (the rounds that overlap), where both have one."""
    out = {}
    for m, r in rows.items():
        if m not in overlapped:
            continue
        name = next((m[: -len(x)] for x in ("-overlap", "+overlap") if m.endswith(x)), parse_method(m)[0])
        twin = rows.get(name)
        if not (twin and name not in overlapped and r.get("exchange_wait_s") is not None
                and twin.get("exchange_wait_s")):
            continue
        ratio = lambda key: round(r[key] / twin[key], 4) if r.get(key) and twin.get(key) else None  # noqa: E731
        out[m] = {"blocking": name, "exposed_wait_ratio": ratio("exchange_wait_s"),
                  "time_to_target_ratio": ratio("time_to_target_s"), "train_wall_ratio": ratio("train_wall_s")}
        if r.get("frozen_exchange_wait_per_round_s") is not None:   # overlapped once frozen: those rounds alone
            out[m]["frozen_exposed_wait_ratio"] = ratio("frozen_exchange_wait_per_round_s")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts M (namespaces)")
    p.add_argument("--ranks-per-host", type=int, default=2, help="ranks P on every host")
    p.add_argument("--bandwidths", default="100mbit,1gbit", help="comma list, tc units (kbit, mbit, gbit)")
    p.add_argument("--latency", default="0ms", help="one-way host-to-host latency added with netem (e.g. 2ms)")
    p.add_argument("--mtu", type=int, default=9000, help="MTU of every link (GSO is capped to it)")
    p.add_argument("--racks", type=int, default=1,
                   help="racks R: host k in rack k // (hosts / R), one switch per rack, the racks' switches joined "
                        "by a spine switch; every job gets --nodes-per-rack hosts/R (1: one switch, no spine)")
    p.add_argument("--spine-bandwidth", default=None,
                   help="rate of every rack's link to the spine, each direction, tc units (default: the host "
                        "bandwidth of the run); ignored with --racks 1")
    p.add_argument("--spine-latency", default="0ms",
                   help="extra one-way latency between hosts of different racks (netem); ignored with --racks 1")
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help="comma list; METHOD@mpi or METHOD@horovod runs it under that control plane "
                        "(dense@mpi: the library's bucketed allreduce over mpi4py instead of Horovod's optimizer); "
                        "METHOD+LABEL is another job of METHOD with its own --method-args METHOD+LABEL=ARGS")
    p.add_argument("--target", type=float, default=0.90, help="test accuracy that counts as reached")
    p.add_argument("--train-args", default=DEFAULT_TRAIN_ARGS,
                   help="arguments for `prunex-hvd train`, the same for every method (--method and --out are added)")
    p.add_argument("--method-args", action="append", default=[], metavar="METHOD=ARGS",
                   help="extra `prunex-hvd train` arguments for one method, after the shared ones (repeatable), "
                        "e.g. 'localsgd-hier=--warmup-epochs 2' (every method takes the same --lr: docs/tuning.md)")
    p.add_argument("--collectives", choices=("ring", "default"), default="ring",
                   help="ring: force Open MPI's ring allreduce/allgather(v) (what the library accounts); "
                        "default: Open MPI's own choice")
    p.add_argument("--control-plane", choices=("auto", "horovod", "mpi"), default="auto",
                   help="auto: Horovod only in the jobs whose tensors go through it (dense); horovod: every "
                        "job (the library's default under mpirun); mpi: none (dense then is the library's "
                        "bucketed allreduce, not Horovod's optimizer)")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds per job before its mpirun is killed")
    p.add_argument("--stop-at-target", action="store_true",
                   help="stop each job once it has reached --target (its time to target is all the run measures; "
                        "its final accuracy is then the one at the target)")
    p.add_argument("--max-minutes", type=float, default=40, help="whole benchmark; jobs beyond it are skipped")
    p.add_argument("--out", default="runs/cluster")
    p.add_argument("--keep", action="store_true", help="leave the namespaces up at the end (debugging)")
    p.add_argument("--cleanup", action="store_true", help="only remove leftovers of an earlier run, then exit")
    args = p.parse_args(argv)
    try:
        bandwidths = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
        rates = {b: parse_rate(b) for b in bandwidths}
        latency_ms = parse_ms(args.latency)
        spine_bps = parse_rate(args.spine_bandwidth) if args.spine_bandwidth else None
        spine_latency_ms = parse_ms(args.spine_latency)
    except ValueError as exc:
        p.error(str(exc))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if parse_method(m)[0] not in ALL_METHODS
               or parse_method(m)[1] not in ("", "mpi", "horovod")]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {', '.join(ALL_METHODS)}")
    if not (1 <= args.hosts <= 250) or args.ranks_per_host < 1:
        p.error("need 1 <= --hosts <= 250 and --ranks-per-host >= 1")
    try:
        rack_of = rack_of_hosts(args.hosts, args.racks)
    except ValueError as exc:
        p.error(str(exc))
    method_args = {}
    for item in args.method_args:
        m, sep, extra = item.partition("=")
        listed = args.methods.split(",")
        if not sep or m not in listed + [x.partition("@")[0] for x in listed] + [parse_method(x)[0] for x in listed]:
            p.error(f"--method-args {item!r}: expected METHOD=ARGS for one of --methods ({args.methods})")
        method_args[m] = extra
    args.method_args = method_args
    from prunex_hvd.app.cli import refuse_removed_flags
    for extra in [args.train_args] + list(method_args.values()):
        if "--method" in extra.split() or "--out" in extra.split():
            p.error("--train-args and --method-args must not hold --method or --out (the script sets them)")
        try:   # a removed or config-only flag would fail every job, after the build
            refuse_removed_flags(extra.split())
        except ValueError as exc:
            p.error(str(exc))

    problem = preflight()
    if problem:
        print(f"emulated_cluster: refusing to run: {problem}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = teardown()
        print(json.dumps({"removed_namespaces": removed}))
        return 0
    leftovers = our_namespaces()
    if leftovers:
        print(f"emulated_cluster: namespaces of an earlier run are still there ({', '.join(leftovers)}): "
              "run with --cleanup first", file=sys.stderr)
        return 2
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)

    mca = {"plm_rsh_agent": AGENT, "plm_rsh_no_tree_spawn": "1", "orte_keep_fqdn_hostnames": "1",
           "oob_tcp_if_include": f"{SUBNET}.0/24", "btl_tcp_if_include": f"{SUBNET}.0/24",
           "btl": "self,vader,tcp", "rmaps_base_oversubscribe": "1"}
    if args.collectives == "ring":
        mca.update(RING_MCA)

    def on_signal(signum, _frame):
        raise Interrupted(f"signal {signum}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    become_subreaper()

    deadline = time.monotonic() + 60 * args.max_minutes
    racked = args.racks > 1
    per_rack = args.hosts // args.racks
    doc = {"benchmark": "emulated_cluster",
           "cluster": {"hosts": args.hosts, "ranks_per_host": args.ranks_per_host, "mtu": args.mtu,
                       "gso_max_size": args.mtu, "latency_one_way_ms": latency_ms,
                       "namespaces": {"hosts": [f"pxh{k}" for k in range(args.hosts)], "switch": SWITCH_NS,
                                      "launcher": LAUNCH_NS},
                       "addresses": {**{f"pxh{k}": f"{SUBNET}.{k + 1}/24" for k in range(args.hosts)},
                                     LAUNCH_NS: f"{SUBNET}.254/24"},
                       "kernel_bytes": "sum over hosts of /sys/class/net/eth0/statistics/tx_bytes inside each "
                                       "host namespace, minus rx_bytes of the launcher's eth0; whole job",
                       "shaping": {}, "link_check_mbit": {}},
           "mpirun_mca": mca, "collectives": args.collectives, "control_plane": args.control_plane,
           "train_args": args.train_args, "method_args": args.method_args, "target": args.target, "results": [], "summary": {}}
    if racked:
        doc["cluster"].update(
            racks=args.racks, hosts_per_rack=per_rack, rack_of_host={f"pxh{k}": r for k, r in enumerate(rack_of)},
            spine_bandwidth={}, spine_latency_one_way_ms=spine_latency_ms, spine_shaping={}, spine_check_mbit={},
            kernel_spine_bytes="sum over racks of tx_bytes of the rack switch's uplink (bytes leaving a rack for "
                               "another), minus the launcher's traffic with racks 1.. (htb class counters on its "
                               "link); whole job")
        doc["cluster"]["namespaces"] = {"hosts": [f"pxh{k}" for k in range(args.hosts)],
                                        "switches": switch_names(args.racks), "spine": SPINE_NS, "launcher": LAUNCH_NS}
    status = 0
    try:
        log(f"building {args.hosts} hosts x {args.ranks_per_host} ranks (mtu {args.mtu})"
            + (f" in {args.racks} racks of {per_rack}" if racked else ""))
        build(args.hosts, args.mtu, args.racks)
        for bw in bandwidths:
            doc["cluster"]["shaping"][bw] = shape(args.hosts, rates[bw], latency_ms, args.mtu, args.racks)
            if racked:
                doc["cluster"]["spine_bandwidth"][bw] = args.spine_bandwidth or bw
                doc["cluster"]["spine_shaping"][bw] = shape_spine(args.racks, spine_bps or rates[bw],
                                                                  spine_latency_ms, args.mtu)
            if args.hosts >= 2 and per_rack >= 2:   # pxh0 and pxh1 share a switch
                doc["cluster"]["link_check_mbit"][bw] = link_check()
                log(f"{bw}: one TCP stream pxh0 -> pxh1 gets {doc['cluster']['link_check_mbit'][bw]} Mbit/s")
            elif racked:
                doc["cluster"]["link_check_mbit"][bw] = None   # one host per rack: no pair behind one switch
            if racked:
                doc["cluster"]["spine_check_mbit"][bw] = link_check(dst=per_rack)
                log(f"{bw}: one TCP stream pxh0 -> pxh{per_rack} (rack 0 -> rack 1, spine "
                    f"{doc['cluster']['spine_bandwidth'][bw]}) gets {doc['cluster']['spine_check_mbit'][bw]} Mbit/s")
            for method in methods:
                left = deadline - time.monotonic()
                if left < 30:
                    doc["results"].append({"bandwidth": bw, "method": method, "status": "skipped",
                                           "reason": "--max-minutes reached"})
                    log(f"{bw} {method}: skipped (--max-minutes reached)")
                    continue
                doc["results"].append(run_one(args, bw, method, mca, min(args.run_timeout, left)))
    except (KeyboardInterrupt, Interrupted) as exc:
        log(f"interrupted ({exc or 'Ctrl-C'}): tearing down")
        doc["interrupted"] = True
        status = 130
    except RuntimeError as exc:
        log(f"failed: {exc}")
        doc["error"] = str(exc)
        status = 2
    except subprocess.CalledProcessError as exc:
        log(f"failed: {' '.join(exc.cmd)}: {(exc.stderr or '').strip()}")
        doc["error"] = f"{' '.join(exc.cmd)}: {(exc.stderr or '').strip()}"
        status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if args.keep and status == 0:
            log("--keep: namespaces left up; remove them with --cleanup")
        else:
            teardown()
        reap()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    for bw in bandwidths:
        rows = {r["method"]: r for r in doc["results"] if r["bandwidth"] == bw and r.get("status") != "skipped"}
        dense_t = (rows.get("dense") or {}).get("time_to_target_s")
        dense_mpi_t = (rows.get("dense@mpi") or {}).get("time_to_target_s")
        summary = {}
        for m, r in rows.items():
            t = r.get("time_to_target_s")
            r["speedup_to_target_vs_dense"] = round(dense_t / t, 2) if dense_t and t else None
            if "dense@mpi" in rows:
                r["speedup_to_target_vs_dense_mpi"] = round(dense_mpi_t / t, 2) if dense_mpi_t and t else None
            summary[m] = {"time_to_target_s": t, "speedup_vs_dense": r["speedup_to_target_vs_dense"],
                          "final_test_acc": r.get("final_test_acc"), "kernel_over_library": r.get("kernel_over_library"),
                          "kernel_over_ledger": r.get("kernel_over_ledger")}
            if "dense@mpi" in rows:
                summary[m]["speedup_vs_dense_mpi"] = r["speedup_to_target_vs_dense_mpi"]
        if "prunex" in rows and "dense" in rows:
            sp = rows["prunex"]["speedup_to_target_vs_dense"]
            t, dense = rows["prunex"].get("time_to_target_s"), rows["dense"]
            if sp is None and t and dense.get("time_to_target_s") is None and dense.get("train_wall_s"):
                # dense was stopped before the target: its last evaluated wall time is a lower bound
                sp = round(dense["train_wall_s"] / t, 2)
                summary["prunex"]["speedup_vs_dense_at_least"] = sp
            summary["prunex_at_least_3x_faster_than_dense"] = None if sp is None else sp >= 3
        summary.update(rival_speedups(rows))
        overlapped = {m for m in rows if overlaps((args.train_args + " " + args.method_args.get(
            m, args.method_args.get(parse_method(m)[0], ""))).split())}
        pairs = overlap_pairs(rows, overlapped)
        if pairs:
            summary["overlap_vs_blocking"] = pairs
        doc["summary"][bw] = summary
    text = json.dumps(doc, indent=2)
    with open(os.path.join(args.out, "emulated_cluster.json"), "w") as f:
        f.write(text + "\n")
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
