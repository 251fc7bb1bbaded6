"""Which of this host's addresses and network interfaces reach a peer, and which one gloo will
advertise to the other ranks. The standard library only (no torch): the frontend and the PD
transfer backends use it too.

A host's ranks must advertise an address the other nodes can reach. Gloo's default is the
address this host's name resolves to, which on a stock machine is a loopback one (127.0.1.1 on
Debian / Ubuntu): fine on one node, unreachable from another. So, unless GLOO_SOCKET_IFNAME or
--dist-socket-ifname names one, the ranks take the interface whose route leads to
--dist-init-addr's host (`gloo_interface`); a route over loopback (one node on 127.0.0.1) changes
nothing.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import NamedTuple

SIOCGIFADDR = 0x8915
IFNAME_FLAG = "--dist-socket-ifname"
IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def resolve(host: str) -> str:
    """`host`'s address: itself when it is one, else its IPv4 address, else the first one the
    resolver gives (OSError when it has none)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def local_ip(toward: str) -> str:
    """This host's address on the route to `toward` (no packet is sent); 127.0.0.1 when there is
    no route (or `toward` does not resolve)."""
    try:
        ip = resolve(toward)
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _ipv4_of(name: str) -> str | None:
    """The (primary) IPv4 address of interface `name`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = struct.pack("256s", name.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
        except OSError:
            return None


def _ipv6_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv6 address (/proc/net/if_inet6), or [] without IPv6."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [(r[5], str(ipaddress.IPv6Address(bytes.fromhex(r[0])))) for r in rows if len(r) >= 6]


def interface_addresses() -> dict[str, list[str]]:
    """Every interface of this host (network namespace) with its addresses, IPv4 first."""
    out = {name: [ip] if (ip := _ipv4_of(name)) else [] for _, name in socket.if_nameindex()}
    for name, ip in _ipv6_addresses():
        out.setdefault(name, []).append(ip)
    return out


def interface_of(ip: str) -> str | None:
    """The interface that holds address `ip`, or None."""
    want = ipaddress.ip_address(ip.split("%")[0])
    for name, ips in interface_addresses().items():
        if any(ipaddress.ip_address(a) == want for a in ips):
            return name
    return None


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


class Choice(NamedTuple):
    """The interface the ranks of this host use (None: gloo's default, the hostname's address)
    and why, in words an error message can quote."""
    ifname: str | None
    why: str


def gloo_interface(init_host: str, flag: str | None = None) -> Choice:
    """--dist-socket-ifname, else GLOO_SOCKET_IFNAME, else the interface on the route to
    `init_host` (--dist-init-addr's host) when that route is not loopback. A named interface
    that this host lacks is refused, with those it has."""
    if flag or os.environ.get(IFNAME_ENV):
        names = flag or os.environ[IFNAME_ENV]
        source = f"{IFNAME_FLAG} {names}" if flag else f"{IFNAME_ENV}={names}"
        have = interface_addresses()
        for name in names.split(","):
            if not have.get(name):
                listed = ", ".join(f"{n} ({' '.join(a) or 'no address'})" for n, a in have.items())
                raise ValueError(f"{source}: this host has no interface {name!r} with an address; it has "
                                 f"{listed}")
        return Choice(names, source)
    ip = local_ip(init_host)
    if _is_loopback(ip):
        return Choice(None, f"the route to {init_host} stays on this host (loopback), so gloo takes the "
                            f"address its hostname {socket.gethostname()!r} resolves to")
    name = interface_of(ip)
    if name is None:
        return Choice(None, f"no interface holds {ip}, this host's address toward {init_host}; gloo takes "
                            f"the address its hostname {socket.gethostname()!r} resolves to")
    return Choice(name, f"the route to {init_host} (--dist-init-addr) leaves through {name} ({ip})")


def _bindable(ip: str) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def gloo_addresses(ifname: str | None) -> list[str]:
    """The addresses gloo advertises for this host: the first of each named interface (IPv4
    first, as getifaddrs lists them), else the first bindable address this host's name resolves
    to, else 127.0.0.1 (torch's ProcessGroupGloo.createDefaultDevice)."""
    if ifname:
        have = interface_addresses()
        return [have[name][0] for name in ifname.split(",") if have.get(name)]
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        if _bindable(info[4][0]):
            return [info[4][0]]
    return ["127.0.0.1"]
