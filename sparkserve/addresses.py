"""What an address lets in: the rules start-up checks apply to the addresses servers listen on."""
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
