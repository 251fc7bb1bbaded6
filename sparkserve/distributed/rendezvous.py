"""How the ranks meet before torch.distributed forms their world: what torch's tcp:// rendezvous
does (rank 0 hosts a TCPStore at --dist-init-addr, the others join it; listening at that address
only, where torch's would listen on every interface), plus two checks that turn its silent waits
into errors within --dist-timeout:

- every rank writes its entry; a rank missing at the deadline is named, with its node (torch's
  store would wait out its timeout, a year for the world's, then say only how many joined);
- every rank connects once to every other rank at the addresses its gloo will advertise
  (`interface.gloo_addresses`, over a listening socket opened there for the check). An address
  that cannot be reached (a hostname that resolves to loopback on a node of several) fails
  every rank at once, naming that address, why the node advertises it and the settings that
  change it, instead of gloo's mesh retrying or waiting on its own.

The store and the groups formed on it trust every peer that reaches them (the control group
carries pickled objects): --dist-init-addr is refused on a public or wildcard address (addresses.py
`check_rendezvous_ip`) unless --dist-allow-public-bind."""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import time
from typing import Callable, Iterator

import torch.distributed as dist

from sparkserve.args import ParallelConfig
from sparkserve.distributed import interface

_KEY = "sparkserve/rendezvous"
PROBE_CONNECT_S = 5.0        # one check connection's limit (a dropped SYN; a refusal is at once)


@contextlib.contextmanager
def env(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` inside (None: left as it is), and as it was after: gloo reads
    GLOO_SOCKET_IFNAME whenever a group is made, and this process may be the user's."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def join(cfg: ParallelConfig, rank: int, host: str, port: int, timeout_s: float, choice: interface.Choice,
         wrap: Callable[[dist.Store], dist.Store] | None = None) -> dist.Store:
    """The world's store once every rank has joined it and reached every other (rank 0 hosts it,
    seen through `wrap` when given); RuntimeError naming what failed, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    where = f"{host}:{port}"
    store = _open(cfg, rank, host, port, timeout_s)
    if wrap is not None:
        store = wrap(store)
    listeners = [_listen(ip) for ip in interface.gloo_addresses(choice.ifname)]
    try:
        me = {"node": cfg.node_rank, "host": socket.gethostname(), "why": choice.why,
              "addrs": [sock.getsockname()[:2] for sock in listeners]}
        store.set(f"{_KEY}/rank/{rank}", json.dumps(me))
        peers = _wait_all(store, "rank", cfg, deadline, timeout_s, where)
        failures = [f for q, peer in enumerate(peers) if q != rank and (f := _reach(q, peer, deadline))]
        store.set(f"{_KEY}/reach/{rank}", json.dumps(failures))
        reached = _wait_all(store, "reach", cfg, deadline, timeout_s, where)
        store.set(f"{_KEY}/read/{rank}", "1")
        if rank == 0:        # the others have read all they need before rank 0 may close the store
            with contextlib.suppress(dist.DistError):
                store.wait([f"{_KEY}/read/{r}" for r in range(cfg.world_size)],
                           datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
    finally:
        for sock in listeners:
            sock.close()
    for r, failed in enumerate(reached):
        for q, ip, err in failed:
            raise RuntimeError(_unreachable(peers, r, q, ip, err))
    return store


def _open(cfg: ParallelConfig, rank: int, host: str, port: int, timeout_s: float) -> dist.Store:
    where = f"{host}:{port}"
    fd = _bound(host, port) if rank == 0 else None
    try:
        return dist.TCPStore(host, port, cfg.world_size, rank == 0, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd)
    except dist.DistError as e:
        if rank == 0:
            raise RuntimeError(f"rank 0 cannot host the ranks' rendezvous at --dist-init-addr {where}: {e}. "
                               "Give a free port on an address of this host") from None
        raise RuntimeError(
            f"rank {rank} (node {cfg.node_rank}) could not reach the ranks' rendezvous at --dist-init-addr "
            f"{where} within --dist-timeout {timeout_s:g}s: start node 0 (--node-rank 0) with the same "
            f"--dist-init-addr, and check that {host} is node 0's address as this node reaches it "
            f"({e})") from None


def _bound(host: str, port: int) -> int | None:
    """A socket listening at --dist-init-addr's address only, for rank 0's store (which would
    otherwise listen on every interface of the host), handed over as its fd; None where that
    address is none of this host's (a NAT'd or forwarded one): the store then listens on all."""
    try:
        ip = interface.resolve(host)
    except OSError:
        return None
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:
            return None
        raise RuntimeError(f"rank 0 cannot host the ranks' rendezvous at --dist-init-addr {host}:{port}: "
                           f"{e.strerror}. Give a free port on an address of this host") from None
    return sock.detach()                  # the store owns it now


def _listen(ip: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((ip, 0))
    sock.listen(64)       # the kernel completes the peers' connections: nothing needs to accept
    return sock


def _reach(q: int, peer: dict, deadline: float) -> tuple[int, str, str] | None:
    """The first of rank q's addresses this rank cannot connect to, as (q, address, why)."""
    for ip, port in peer["addrs"]:
        limit = max(0.1, min(PROBE_CONNECT_S, deadline - time.monotonic()))
        try:
            socket.create_connection((ip, port), timeout=limit).close()
        except OSError as e:
            return q, ip, e.strerror or str(e) or type(e).__name__
    return None


def _unreachable(peers: list[dict], r: int, q: int, ip: str, err: str) -> str:
    me, p = peers[r], peers[q]
    return (f"the ranks cannot connect: rank {r} (node {me['node']}, host {me['host']!r}) could not reach "
            f"rank {q} (node {p['node']}, host {p['host']!r}) at {ip}, the address its gloo advertises "
            f"({err}). On node {p['node']}, {p['why']}. Set {interface.IFNAME_FLAG} (or "
            f"{interface.IFNAME_ENV}) on that node to the interface on the network between the nodes, or "
            "give --dist-init-addr node 0's address on that network")


def _wait_all(store: dist.Store, what: str, cfg: ParallelConfig, deadline: float, timeout_s: float,
              where: str) -> list:
    """Every rank's `what` entry, waiting until the deadline; RuntimeError naming the ranks (and
    their nodes) that never wrote theirs."""
    keys = [f"{_KEY}/{what}/{r}" for r in range(cfg.world_size)]
    try:
        try:
            store.wait(keys, datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except dist.DistError:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if missing:
                raise RuntimeError(_never(missing, what, cfg, timeout_s, where)) from None
        return [json.loads(store.get(k)) for k in keys]
    except dist.DistError:           # the store went away: rank 0 gave up (and says why)
        raise RuntimeError(f"the ranks' rendezvous at {where} closed while this rank waited for the others: "
                           "see node 0's error") from None


def _never(missing: list[int], what: str, cfg: ParallelConfig, timeout_s: float, where: str) -> str:
    nodes = sorted({r // cfg.ranks_per_node for r in missing})
    verb = "joined" if what == "rank" else "finished checking its connections"
    return (f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} (node{'s' * (len(nodes) > 1)} "
            f"{', '.join(map(str, nodes))}) never {verb} at --dist-init-addr {where} within --dist-timeout "
            f"{timeout_s:g}s: start `sparkserve serve --node-rank N` on each node missing, with the same "
            f"--dist-init-addr, --nnodes {cfg.nnodes} and layout flags, check that it reaches {where}, or "
            "raise --dist-timeout")
