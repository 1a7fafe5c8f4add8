"""``inet_addr_local()``: the addresses and netmasks of the local interfaces that are up.

Postfix reads them with getifaddrs(3) to build the mynetworks default; so does this,
through ctypes. It is a module of its own, imported only when a mynetworks default is
computed, because ctypes and ``ctypes.util`` (which pulls in tempfile, shutil and the
compression modules) add about a megabyte to every process that imports them, and the
daemon seldom needs them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import ipaddress
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
    ("netmask", ctypes.POINTER(_SockAddr)),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
]

_IFF_UP = 0x1


def _sockaddr_ip(sa: _SockAddr) -> IPAddress | None:
    raw = bytes(sa.data)
    if sa.family == socket.AF_INET:
        return ipaddress.IPv4Address(raw[2:6])
    if sa.family == socket.AF_INET6:
        return ipaddress.IPv6Address(raw[6:22])
    return None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def local_interfaces(family: int) -> list[tuple[IPAddress, IPAddress]]:
    """(address, netmask) of the interfaces that are up, in getifaddrs() order."""
    libc = _libc()
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        node = head
        while node:
            entry = node.contents
            node = entry.next
            if not entry.flags & _IFF_UP or not entry.addr or not entry.netmask:
                continue
            if entry.addr.contents.family != family:
                continue
            addr = _sockaddr_ip(entry.addr.contents)
            if addr is None or int(addr) == 0:
                continue
            mask_sa = entry.netmask.contents
            mask_sa.family = family
            mask = _sockaddr_ip(mask_sa)
            if mask is not None:
                found.append((addr, mask))
    finally:
        libc.freeifaddrs(head)
    return found


