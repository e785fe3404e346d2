"""TLS and mutual TLS for every gRPC hop (and the HTTP gateway).

One `TLSConfig` per process: its certificate is what its servers present and what its clients
present on the hops they dial (router -> workers, decode -> prefill), and `ca` is what the other
side's certificate must chain to. With a CA set, servers require a client certificate (mutual
TLS), except where a caller turns that off (the router's public API, which may rely on API keys).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path!r}: {e.strerror or e}.") from None


@dataclass(frozen=True)
class TLSConfig:
    """cert / key: PEM files of this service's certificate chain and private key. ca: a PEM
    bundle of the CAs that peers' certificates must chain to (servers then require client
    certificates; clients verify servers against it instead of the system roots).
    server_name: the name to verify on outgoing hops when it differs from the dialled host."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither.")
        if self.cert is None and self.ca is None:
            raise ValueError("TLS needs a certificate (--tls-cert/--tls-key) or a CA (--tls-ca).")
        for path, what in ((self.cert, "TLS certificate"), (self.key, "TLS key")):
            if path is not None:
                _read(path, what)
        if self.ca is not None:
            _read(self.ca, "TLS CA bundle")

    @classmethod
    def from_flags(
        cls, cert: str | None, key: str | None, ca: str | None, server_name: str | None = None
    ) -> TLSConfig | None:
        """None when no TLS flag is set (plaintext, the default on loopback)."""
        if not (cert or key or ca):
            return None
        return cls(cert or None, key or None, ca or None, server_name or None)

    @property
    def can_serve(self) -> bool:
        return self.cert is not None

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        """For a server: present the certificate; with a CA (and `require_client_cert`), accept
        only clients whose certificate chains to it."""
        if self.cert is None or self.key is None:
            raise ValueError("a TLS server needs --tls-cert and --tls-key.")
        ca = _read(self.ca, "TLS CA bundle") if self.ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))],
            root_certificates=ca,
            require_client_auth=ca is not None and require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For a client: verify the server against the CA, present our certificate if any."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "TLS CA bundle") if self.ca else None,
            private_key=_read(self.key, "TLS key") if self.key else None,
            certificate_chain=_read(self.cert, "TLS certificate") if self.cert else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]

    def ssl_server_context(self, require_client_cert: bool = False) -> ssl.SSLContext:
        """For the HTTPS gateway: the same certificate, client certificates as for gRPC."""
        if self.cert is None or self.key is None:
            raise ValueError("an HTTPS server needs --tls-cert and --tls-key.")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.ca is not None and require_client_cert:
            context.load_verify_locations(self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context
