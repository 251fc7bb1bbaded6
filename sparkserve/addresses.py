"""What an address lets in: the rules start-up checks apply to the addresses servers listen on and
the ranks meet at (one place for the PD bootstrap service and the torch.distributed rendezvous)."""
from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback only (what other machines cannot reach)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def split_host_port(addr: str) -> tuple[str, int]:
    """--dist-init-addr 'HOST:PORT' or '[V6]:PORT' (as torch's tcp:// rendezvous reads it)."""
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--dist-init-addr {addr}: give HOST:PORT (e.g. 10.0.0.1:29500)")
    return host, int(port)


def check_rendezvous_ip(host: str, ip: str, allow_public: bool) -> None:
    """Refuse the ranks' rendezvous on `host` (whose address is `ip`; a name not yet resolved
    passes) when that is a wildcard or globally routable address, unless --dist-allow-public-bind:
    torch.distributed's store and the control group's pickled messages trust every peer that
    reaches them. Loopback and private ranges pass."""
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return
    why = ("a wildcard address (every interface of the host)" if addr.is_unspecified else
           "a globally routable address" if addr.is_global else None)
    if why and not allow_public:
        shown = host if host == ip else f"{host} ({ip})"
        raise ValueError(
            f"--dist-init-addr {shown} is {why}: the ranks' rendezvous (torch.distributed's store, and the "
            "control messages that carry pickled objects) trusts every peer that reaches it, so anyone who "
            "can reach that port could run code in the server. Give node 0's address on a private network "
            "(loopback, 10/8, 172.16/12, 192.168/16, fc00::/7), or pass --dist-allow-public-bind if this "
            "network is trusted anyway (firewalled to the nodes)")
