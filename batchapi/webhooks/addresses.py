"""Where a webhook may be posted: only to public addresses, unless the deployment allows private
ones (``webhook_allow_private``) or names some hosts and networks (``webhook_allowed_hosts``), so
an API key cannot make the service POST into its own network (SSRF: loopback, the cloud metadata
address, internal hosts). Checked when an endpoint is registered (``check_host``) and again at
each delivery (``pin``), which then connects to the very address it checked, so a name pointed
elsewhere since (DNS rebinding) gets no POST."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from batchapi.config import Settings
from batchapi.errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class ForbiddenAddress(InvalidRequest):
    """The host is, or resolves to, an address that is not public, and is not allowed."""

    code = "webhook_url_forbidden"


class HostUnresolved(InvalidRequest):
    """At delivery, the host resolves to nothing: no POST (the resolver's next answer is not trusted)."""

    code = "webhook_endpoint_unreachable"


@dataclass(frozen=True)
class Target:
    """What a POST goes to: the URL with its host replaced by the address checked, and the host
    name sent as ``Host`` and, for https, as the TLS server name (so the certificate is still checked
    against the name)."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, str] = field(default_factory=dict)


def address_class(ip: IPAddress) -> str | None:
    """What kind of non-public address ``ip`` is ("loopback", "private", ...); None if public."""
    if isinstance(ip, ipaddress.IPv6Address):  # an IPv4 address inside IPv6 is judged as itself
        ip = ip.ipv4_mapped or ip.sixtofour or ip
    for kind, matches in (("loopback", ip.is_loopback), ("unspecified", ip.is_unspecified),
                          ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                          ("reserved", ip.is_reserved), ("private", ip.is_private)):
        if matches:
            return kind
    return None if ip.is_global else "non-public"  # e.g. 100.64.0.0/10, carrier-grade NAT


def check_host(settings: Settings, host: str, port: int) -> list[IPAddress] | None:
    """The addresses ``host`` resolves to, every one public or in an allowed network (empty: the
    name does not resolve); None when the host is allowed unchecked (``webhook_allow_private``, or
    its name is in ``webhook_allowed_hosts``). ForbiddenAddress for any other address."""
    host = host.lower().rstrip(".")
    if settings.webhook_allow_private or host in settings.webhook_allowed_hosts:
        return None
    addresses = resolve(host, port)
    networks = _allowed_networks(settings)
    for ip in addresses:
        kind = address_class(ip)
        if kind is not None and not any(ip in net for net in networks if net.version == ip.version):
            named = "" if _literal(host) else f" resolves to {ip}, which"
            raise ForbiddenAddress(
                f"webhook URL refused: {host}{named} is not a public address ({kind}); a deployment allows "
                "such hosts with BATCHAPI_WEBHOOK_ALLOW_PRIVATE or BATCHAPI_WEBHOOK_ALLOWED_HOSTS", "url")
    return addresses


def pin(settings: Settings, url: str) -> Target:
    """The POST target for ``url`` now: ForbiddenAddress or HostUnresolved if there is none."""
    parts = urlsplit(url)
    addresses = check_host(settings, parts.hostname or "", parts.port or default_port(parts.scheme))
    if addresses is None or _literal(parts.hostname or ""):
        return Target(url)
    if not addresses:
        raise HostUnresolved(f"{parts.hostname} does not resolve", "url")
    ip = addresses[0]
    name = _idna(parts.hostname)  # as DNS and TLS know it, and as a header can carry it
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + (f"[{ip}]" if ip.version == 6 else str(ip))
    port = f":{parts.port}" if parts.port is not None else ""
    extensions = {"sni_hostname": name} if parts.scheme == "https" else {}
    return Target(parts._replace(netloc=netloc + port).geturl(), {"host": name + port}, extensions)


def _idna(host: str) -> str:
    """``host`` in ASCII: a name beyond it in its IDNA (punycode) form; HostUnresolved where it has none."""
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        raise HostUnresolved(f"{host} is not a host name that can be sent", "url") from None


def resolve(host: str, port: int) -> list[IPAddress]:
    """``host``'s addresses, as the connection would find them (an IP literal: itself)."""
    literal = _literal(host)
    if literal is not None:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # no such name, or one the resolver cannot encode
        return []
    found = [ipaddress.ip_address(info[4][0]) for info in infos]
    return list(dict.fromkeys(found))


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _allowed_networks(settings: Settings) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    # config.py checked that every entry that looks like an address is a valid network; the rest are names
    networks = []
    for entry in settings.webhook_allowed_hosts:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            continue
    return networks


def default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80
