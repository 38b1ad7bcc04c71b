"""The operator-managed CA's rotation plan, on a simulated clock: at every moment the served certificate
verifies against the bundle every client may hold, expired CAs leave the bundle, and a plan applied to
its own output changes nothing."""

from __future__ import annotations

import datetime as dt
import ssl

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from sidecar.operator import certs

NAMES = certs.dns_names("strata", "strata-system")
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
#: Short lifetimes, so a few years of rotations fit in a few hundred plan() calls.
POLICY = certs.TlsPolicy(ca_validity=dt.timedelta(days=60), cert_validity=dt.timedelta(days=12))


def verifies(state: certs.TlsState, bundle: bytes, now: dt.datetime) -> bool:
    """The serving certificate is valid at ``now`` and issued by a CA of ``bundle`` valid at ``now``."""
    leaf = state.serving.x509
    if not leaf.not_valid_before_utc <= now < leaf.not_valid_after_utc:
        return False
    for pem in certs._split_pem(bundle):
        ca = x509.load_pem_x509_certificate(pem)
        if ca.subject != leaf.issuer or not ca.not_valid_before_utc <= now < ca.not_valid_after_utc:
            continue
        try:
            leaf.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False


def test_a_new_state_is_one_ca_and_a_certificate_for_the_service_names() -> None:
    state, changes = certs.plan(None, names=NAMES, now=T0, policy=POLICY)
    assert [c.kind for c in changes] == ["created"]
    assert verifies(state, state.bundle, T0)
    sans = state.serving.x509.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == NAMES
    assert state.signing.x509.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # idempotent: the same state at the same time is kept as it is
    again, changes = certs.plan(state, names=NAMES, now=T0, policy=POLICY)
    assert changes == [] and again == state


def test_the_secret_data_round_trips_and_garbage_reads_as_nothing() -> None:
    state, _ = certs.plan(None, names=NAMES, now=T0, policy=POLICY)
    assert certs.TlsState.from_data(state.to_data()) == state
    data = state.to_data()
    assert certs.TlsState.from_data({**data, "tls.key": "bm90IGEga2V5"}) is None  # "not a key"
    assert certs.TlsState.from_data({k: v for k, v in data.items() if k != "ca.key"}) is None
    assert certs.TlsState.from_data(None) is None and certs.TlsState.from_data({}) is None
    # Python's own TLS stack accepts the pair and the bundle
    context = ssl.create_default_context()
    context.load_verify_locations(cadata=state.bundle.decode())


def test_three_years_of_rotation_never_leave_a_client_distrusting_the_server() -> None:
    """Every 12 hours for 3 years: a client holds the bundle it saw up to (publish - promote) x CA life
    ago (a webhook configuration not yet patched, a pod admitted then); it must verify the server."""
    state, _ = certs.plan(None, names=NAMES, now=T0, policy=POLICY)
    overlap = POLICY.ca_validity * (POLICY.publish_fraction - POLICY.promote_fraction)
    seen: list[tuple[dt.datetime, bytes]] = [(T0, state.bundle)]
    kinds: list[str] = []
    now = T0
    while now < T0 + dt.timedelta(days=3 * 365):
        now += dt.timedelta(hours=12)
        state, changes = certs.plan(state, names=NAMES, now=now, policy=POLICY)
        kinds += [c.kind for c in changes]
        seen.append((now, state.bundle))
        seen = [(when, bundle) for when, bundle in seen if now - when <= overlap - dt.timedelta(hours=12)]
        for bundle, when in {bundle: when for when, bundle in seen}.items():
            assert verifies(state, bundle, now), (now, when, changes)
        for pem in certs._split_pem(state.bundle):
            assert x509.load_pem_x509_certificate(pem).not_valid_after_utc > now  # nothing expired kept
        assert len(certs._split_pem(state.bundle)) <= 3
        assert certs.plan(state, names=NAMES, now=now, policy=POLICY)[1] == []  # converged
    rotations = 3 * 365 / 60
    assert kinds.count("published") >= int(rotations) - 1
    assert (
        kinds.count("promoted") == kinds.count("published")
        or kinds.count("promoted") == kinds.count("published") - 1
    )
    assert kinds.count("renewed") >= 3 * 365 / 12 * 0.9  # every 2/3 of 12 days, or at a promotion
    assert kinds.count("dropped") >= kinds.count("promoted") - 1


def test_a_certificate_for_other_names_or_from_another_ca_is_reissued() -> None:
    state, _ = certs.plan(None, names=NAMES, now=T0, policy=POLICY)
    other = certs.dns_names("strata", "other-ns")
    moved, changes = certs.plan(state, names=other, now=T0, policy=POLICY)
    assert [c.kind for c in changes] == ["renewed"] and "names" in changes[0].message
    assert moved.signing == state.signing and verifies(moved, state.bundle, T0)
    foreign, _ = certs.plan(None, names=NAMES, now=T0, policy=POLICY)
    mixed = certs.TlsState(state.signing, foreign.serving, state.trusted)
    fixed, changes = certs.plan(mixed, names=NAMES, now=T0, policy=POLICY)
    assert "not signed by the signing CA" in changes[0].message and verifies(fixed, state.bundle, T0)


def test_the_serving_certificate_never_outlives_its_ca() -> None:
    long_cert = certs.TlsPolicy(ca_validity=dt.timedelta(days=30), cert_validity=dt.timedelta(days=365))
    state, _ = certs.plan(None, names=NAMES, now=T0, policy=long_cert)
    assert state.serving.x509.not_valid_after_utc <= state.signing.x509.not_valid_after_utc


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"publish_fraction": 0.1, "promote_fraction": 0.2}, "promote_fraction < publish_fraction"),
        ({"renew_fraction": 1.5}, "renew_fraction"),
        ({"cert_validity": dt.timedelta(0)}, "validities must be positive"),
    ],
)
def test_a_bad_policy_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        certs.TlsPolicy(**kwargs)  # type: ignore[arg-type]
