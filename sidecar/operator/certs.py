"""TLS for the webhooks and the report endpoint, without cert-manager: a CA the operator generates,
rotates and publishes (the webhooks' ``caBundle``, the injected sidecars' CA file), kept in one
Secret that every replica serves from.

The Secret (``Opaque``: the chart creates it empty, the operator fills it) holds:

- ``tls.crt`` / ``tls.key``: the serving certificate, signed by the signing CA, for the Service's
  DNS names;
- ``ca.crt``: the trust bundle, every CA a client should accept (the signing CA first);
- ``ca.key`` / ``signing-ca.crt``: the signing CA;
- ``next-ca.crt`` / ``next-ca.key``: a successor CA, in the bundle but not yet signing.

Rotation without a window where a client distrusts the server: a successor CA joins the bundle when a
third of the signing CA's life is left, and signs only once a sixth is left, so every webhook
configuration and every pod created in between trusts both; a retired CA stays in the bundle until it
expires. The serving certificate is renewed when a third of its life is left (never outliving its
CA). :func:`plan` decides all of it from the Secret and the clock (pure, so tested with any clock);
:class:`SecretTls` writes the Secret with optimistic concurrency (replicas racing on a rotation: one
wins, the others adopt what it wrote), patches ``caBundle`` and reloads the server's context in
place, so connections after a rotation get the new certificate and none is dropped.

:class:`FileTls` serves files instead (a cert-manager Secret mounted into the pod), reloading them
when the kubelet updates the volume.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import aiohttp
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sidecar.operator.kube import Api, ApiError, path

__all__ = [
    "CHANGE_KINDS",
    "Change",
    "FileTls",
    "Pair",
    "SecretTls",
    "TlsPolicy",
    "TlsState",
    "dns_names",
    "plan",
]

log = logging.getLogger("strata.operator.tls")

UTC = dt.UTC


class Change(NamedTuple):
    """One change :func:`plan` made: ``kind`` is one of :data:`CHANGE_KINDS` (a metric label)."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


CHANGE_KINDS = ("created", "dropped", "published", "promoted", "renewed")


@dataclass(frozen=True)
class TlsPolicy:
    """Lifetimes; renewal happens at fractions of them."""

    ca_validity: dt.timedelta = dt.timedelta(days=5 * 365)
    cert_validity: dt.timedelta = dt.timedelta(days=365)
    #: A successor CA is published when this fraction of the signing CA's life is left...
    publish_fraction: float = 1 / 3
    #: ...and takes over signing when this fraction is left.
    promote_fraction: float = 1 / 6
    #: The serving certificate is renewed when this fraction of its life is left.
    renew_fraction: float = 1 / 3

    def __post_init__(self) -> None:
        if not 0 < self.promote_fraction < self.publish_fraction < 1:
            raise ValueError("TlsPolicy: need 0 < promote_fraction < publish_fraction < 1")
        if not 0 < self.renew_fraction < 1:
            raise ValueError("TlsPolicy: renew_fraction must lie in (0, 1)")
        if self.cert_validity <= dt.timedelta(0) or self.ca_validity <= dt.timedelta(0):
            raise ValueError("TlsPolicy: validities must be positive")


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes

    @property
    def x509(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert)


@dataclass(frozen=True)
class TlsState:
    """What the Secret holds (see the module docstring)."""

    signing: Pair
    serving: Pair
    #: Every CA clients trust, PEM each; the signing CA first.
    trusted: tuple[bytes, ...]
    successor: Pair | None = None

    @property
    def bundle(self) -> bytes:
        return b"".join(self.trusted)

    def to_data(self) -> dict[str, str]:
        raw = {
            "tls.crt": self.serving.cert,
            "tls.key": self.serving.key,
            "ca.crt": self.bundle,
            "ca.key": self.signing.key,
            "signing-ca.crt": self.signing.cert,
        }
        if self.successor is not None:
            raw["next-ca.crt"] = self.successor.cert
            raw["next-ca.key"] = self.successor.key
        return {k: base64.b64encode(v).decode() for k, v in raw.items()}

    @classmethod
    def from_data(cls, data: dict[str, str] | None) -> TlsState | None:
        """The state in a Secret's ``data``, or None where it is missing or unreadable (then a new
        CA is generated: nothing signed by an unreadable one can be verified anyway)."""
        try:
            raw = {k: base64.b64decode(v) for k, v in (data or {}).items()}
            signing = Pair(raw["signing-ca.crt"], raw["ca.key"])
            serving = Pair(raw["tls.crt"], raw["tls.key"])
            trusted = tuple(_split_pem(raw["ca.crt"]))
            successor = Pair(raw["next-ca.crt"], raw["next-ca.key"]) if "next-ca.crt" in raw else None
            for pair in (signing, serving, *([successor] if successor else [])):
                pair.x509  # noqa: B018 - parses, or raises
                serialization.load_pem_private_key(pair.key, password=None)
            for cert in trusted:
                x509.load_pem_x509_certificate(cert)
        except (KeyError, ValueError, TypeError):
            return None
        return cls(signing, serving, trusted, successor)


def _split_pem(bundle: bytes) -> list[bytes]:
    """The certificates of a PEM bundle, each PEM."""
    marker = b"-----END CERTIFICATE-----"
    return [part.strip() + b"\n" + marker + b"\n" for part in bundle.split(marker)[:-1]]


def dns_names(service: str, namespace: str) -> list[str]:
    """The names a client may use for ``service`` in ``namespace``."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _key() -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key, pem


def _new_ca(name: str, now: dt.datetime, validity: dt.timedelta) -> Pair:
    key, key_pem = _key()
    # unique even for two replicas generating in the same second: clients pick a CA by subject
    unique = f"{name} CA {now:%Y%m%d%H%M%S}-{os.urandom(4).hex()}"
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, unique)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # clock skew between nodes
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Pair(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def _issue(ca: Pair, names: Sequence[str], now: dt.datetime, validity: dt.timedelta) -> Pair:
    ca_cert = ca.x509
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the signing CA's key is not an EC key")
    key, key_pem = _key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + validity, ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Pair(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def _left(cert: x509.Certificate, now: dt.datetime) -> float:
    """The fraction of ``cert``'s life still ahead (negative once expired)."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return (end - now) / (end - start)


def _serves(state: TlsState, names: Sequence[str], now: dt.datetime, policy: TlsPolicy) -> str | None:
    """Why the serving certificate must be reissued, or None."""
    cert, ca = state.serving.x509, state.signing.x509
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "not signed by the signing CA"
    try:
        sans = set(
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.DNSName
            )
        )
    except x509.ExtensionNotFound:
        sans = set()
    if sans != set(names):
        return f"its names {sorted(sans)} are not {sorted(names)}"
    if _left(cert, now) < policy.renew_fraction:
        return f"it expires {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z"
    return None


def plan(
    state: TlsState | None,
    *,
    names: Sequence[str],
    now: dt.datetime,
    policy: TlsPolicy = TlsPolicy(),
    ca_name: str = "strata-operator",
) -> tuple[TlsState, list[Change]]:
    """The state to hold at ``now``, and what changed (empty: keep ``state`` as it is)."""
    if not names:
        raise ValueError("plan: the serving certificate needs at least one DNS name")
    if state is None:
        ca = _new_ca(ca_name, now, policy.ca_validity)
        return TlsState(ca, _issue(ca, names, now, policy.cert_validity), (ca.cert,)), [
            Change("created", "created a CA and a serving certificate")
        ]
    changes: list[Change] = []
    trusted = [c for c in state.trusted if x509.load_pem_x509_certificate(c).not_valid_after_utc > now]
    if state.signing.cert not in trusted and _left(state.signing.x509, now) > 0:
        trusted.insert(0, state.signing.cert)
    if len(trusted) != len(state.trusted):
        changes.append(Change("dropped", "dropped expired CAs from the bundle"))
    signing, successor = state.signing, state.successor
    left = _left(signing.x509, now)
    if successor is None and left < policy.publish_fraction:
        successor = _new_ca(ca_name, now, policy.ca_validity)
        trusted.append(successor.cert)
        changes.append(Change("published", "published a successor CA in the bundle"))
    if successor is not None and left < policy.promote_fraction:
        signing, successor = successor, None
        changes.append(Change("promoted", "the successor CA took over signing"))
    if signing.cert in trusted:  # the signing CA first: what a reader of ca.crt sees as "the" CA
        trusted.remove(signing.cert)
    trusted.insert(0, signing.cert)
    current = TlsState(signing, state.serving, tuple(trusted), successor)
    why = _serves(current, names, now, policy)
    if why is not None:
        current = replace(current, serving=_issue(signing, names, now, policy.cert_validity))
        changes.append(Change("renewed", f"renewed the serving certificate: {why}"))
    return current, changes


def server_context() -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _load(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """Load a pair into a live context: later handshakes use it, open connections keep theirs.
    ``load_cert_chain`` reads only files: a private directory, removed at once."""
    with tempfile.TemporaryDirectory(prefix="strata-tls-") as tmp:
        cert_file, key_file = os.path.join(tmp, "tls.crt"), os.path.join(tmp, "tls.key")
        for name, data in ((cert_file, cert), (key_file, key)):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_file, key_file)


class SecretTls:
    """The operator-managed CA in a Secret: :meth:`reconcile` once before serving, then
    :meth:`run` keeps it current, and the webhooks' ``caBundle`` with it."""

    def __init__(
        self,
        api: Api,
        *,
        namespace: str,
        secret: str,
        service: str,
        webhook_configurations: Sequence[str] = (),
        policy: TlsPolicy = TlsPolicy(),
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(UTC),
        on_change: Callable[[list[Change]], None] | None = None,
    ) -> None:
        self.api, self.namespace, self.secret = api, namespace, secret
        self.names = dns_names(service, namespace)
        self.webhook_configurations = tuple(webhook_configurations)
        self.policy, self.clock, self.on_change = policy, clock, on_change
        self.context = server_context()
        self.state: TlsState | None = None
        self._url = path("", "v1", "secrets", namespace, secret)

    @property
    def ca_pem(self) -> str:
        """The trust bundle (PEM) sidecars verify the report endpoint with; empty before the first
        reconcile."""
        return self.state.bundle.decode() if self.state else ""

    @property
    def not_after(self) -> float | None:
        """When the served certificate expires (Unix time)."""
        return self.state.serving.x509.not_valid_after_utc.timestamp() if self.state else None

    async def reconcile(self) -> list[Change]:
        """Bring the Secret, the served certificate and the ``caBundle``s up to date; returns what
        changed in the Secret. Raises :class:`ApiError` when the API refuses (the caller retries)."""
        for _ in range(5):
            found = await self.api.get(self._url)
            held = TlsState.from_data((found or {}).get("data"))
            if found is not None and held is None and (found.get("data") or {}):
                log.warning(
                    "Secret %s/%s holds no readable CA; generating a new one", self.namespace, self.secret
                )
            state, changes = plan(held, names=self.names, now=self.clock(), policy=self.policy)
            if changes:
                try:
                    await self._write(found, state)
                except ApiError as exc:
                    if exc.status in (409, 422):  # another replica wrote first: adopt what it wrote
                        continue
                    raise
                log.info("TLS Secret %s/%s: %s", self.namespace, self.secret, "; ".join(map(str, changes)))
                if self.on_change is not None:
                    self.on_change(changes)
            self._adopt(state)
            await self._publish(state.bundle)
            return changes
        raise ApiError(
            409, "Conflict", f"Secret {self.namespace}/{self.secret} kept changing under the operator"
        )

    async def run(self, interval_s: float = 300.0) -> None:
        """Reconcile every ``interval_s`` until cancelled; API errors are logged and retried."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reconcile()
            except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                log.warning("TLS reconcile failed (retried in %.0f s): %r", interval_s, exc)

    def _adopt(self, state: TlsState) -> None:
        if self.state is None or self.state.serving != state.serving:
            _load(self.context, state.serving.cert, state.serving.key)
        self.state = state

    async def _write(self, found: dict[str, Any] | None, state: TlsState) -> None:
        data = state.to_data()
        if found is None:
            body = {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",  # as the chart creates it; more keys than a kubernetes.io/tls Secret
                "metadata": {"name": self.secret, "namespace": self.namespace},
                "data": data,
            }
            await self.api.create(path("", "v1", "secrets", self.namespace), body)
            return
        stale = {k: None for k in (found.get("data") or {}) if k not in data}
        rv = (found.get("metadata") or {}).get("resourceVersion")
        await self.api.merge_patch(
            self._url, {"metadata": {"resourceVersion": rv}, "data": {**data, **stale}}
        )

    async def _publish(self, bundle: bytes) -> None:
        """``caBundle`` of every webhook of the named configurations, where it differs."""
        encoded = base64.b64encode(bundle).decode()
        for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            for name in self.webhook_configurations:
                url = path("admissionregistration.k8s.io", "v1", kind, name=name)
                found = await self.api.get(url)
                if found is None:
                    continue  # this release has no such configuration (or not yet)
                ops: list[dict[str, Any]] = []
                for i, hook in enumerate(found.get("webhooks") or []):
                    if (hook.get("clientConfig") or {}).get("caBundle") != encoded:
                        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": hook.get("name")})
                        ops.append(
                            {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": encoded}
                        )
                if ops:
                    await self.api.json_patch(url, ops)
                    log.info("patched caBundle of %s %s", kind, name)


class FileTls:
    """A certificate from files (cert-manager's Secret mounted into the pod), reloaded when they
    change; ``ca_file`` (cert-manager's ``ca.crt``) is what injected sidecars are told to trust."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str | None = None) -> None:
        self.cert_file, self.key_file, self.ca_file = cert_file, key_file, ca_file
        self.context = server_context()
        self._stamp: tuple[float, ...] | None = None
        self._ca = ""
        self.not_after: float | None = None
        self.reload()

    @property
    def ca_pem(self) -> str:
        return self._ca

    def _stamps(self) -> tuple[float, ...]:
        files = [self.cert_file, self.key_file, *([self.ca_file] if self.ca_file else [])]
        return tuple(os.stat(f).st_mtime for f in files)

    def reload(self) -> bool:
        """Load the files if they changed since the last load; True when it did."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return False
        self.context.load_cert_chain(self.cert_file, self.key_file)
        with open(self.cert_file, "rb") as f:
            self.not_after = x509.load_pem_x509_certificate(f.read()).not_valid_after_utc.timestamp()
        if self.ca_file:
            with open(self.ca_file) as f:
                self._ca = f.read()
        self._stamp = stamp
        return True

    async def run(self, interval_s: float = 30.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if self.reload():
                    log.info("reloaded TLS files %s", self.cert_file)
            except (OSError, ssl.SSLError) as exc:  # mid-update by the kubelet: next round
                log.warning("TLS files not reloaded (retried in %.0f s): %s", interval_s, exc)
