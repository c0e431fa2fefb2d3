"""The certificate-kind registries of kvcert.fast and kvcert.reference, iterated (never a hard-coded kind list).

A new kind added to both ``CERTIFICATE_KINDS`` is covered here automatically: the registries agree, the
options of ``estimate_options`` make ``kvcert.fast.hajek_attention`` carry what the kind needs, its
batched radius equals the oracle's, and unknown kinds are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcert.fast as F
import kvcert.fast.certificates as FC
import kvcert.reference as R
import kvcert.reference.certificates as RC
from support import assert_certificate_matches_reference, pi_vectors

KIND_NAMES = list(F.CERTIFICATE_KINDS)


def _batch(rng, *, b=2, h_kv=2, g=2, n=30, d=8, dv=5, pi=None):
    q = torch.from_numpy(rng.normal(size=(b, g * h_kv, d)))
    k = torch.from_numpy(rng.normal(size=(b, h_kv, n, d)))
    v = torch.from_numpy(rng.normal(size=(b, h_kv, n, dv)) + 2.0)
    if pi is None:
        pi = torch.from_numpy(rng.uniform(0.1, 0.9, size=(b, h_kv, n)))
    return q, k, v, pi


def test_registries_have_the_same_kinds_in_the_same_order():
    assert tuple(F.CERTIFICATE_KINDS) == tuple(R.CERTIFICATE_KINDS)
    assert len(F.CERTIFICATE_KINDS) > 0
    assert F.KINDS == tuple(F.CERTIFICATE_KINDS) and R.KINDS == tuple(R.CERTIFICATE_KINDS)
    assert FC.CERTIFICATE_KINDS is F.CERTIFICATE_KINDS and RC.CERTIFICATE_KINDS is R.CERTIFICATE_KINDS
    assert FC.KINDS is F.KINDS and RC.KINDS is R.KINDS
    for name in KIND_NAMES:
        fk, rk = F.CERTIFICATE_KINDS[name], R.CERTIFICATE_KINDS[name]
        assert isinstance(fk, F.CertificateKind) and isinstance(rk, R.CertificateKind)
        assert fk.name == rk.name == name
        # same math, so the same statistics, shape and formula in both backends
        assert fk.needs == rk.needs and isinstance(fk.needs, tuple)
        assert all(isinstance(s, str) for s in fk.needs)
        assert fk.per_coordinate is rk.per_coordinate and isinstance(fk.per_coordinate, bool)
        assert fk.summary == rk.summary
        assert isinstance(fk.summary, str) and fk.summary.strip() and "\n" not in fk.summary
        assert callable(fk.radius) and callable(rk.radius)


def test_registries_are_read_only_and_entries_frozen():
    for reg, cls in ((F.CERTIFICATE_KINDS, F.CertificateKind), (R.CERTIFICATE_KINDS, R.CertificateKind)):
        with pytest.raises(TypeError):
            reg["hoeffding"] = reg[KIND_NAMES[0]]
        with pytest.raises(AttributeError):
            reg[KIND_NAMES[0]].needs = ()
        with pytest.raises(ValueError, match="unknown statistics"):
            cls(name="x", needs=("no_such_statistic",), radius=lambda *a, **k: 0.0, per_coordinate=False,
                summary="x")


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_estimate_options_carry_every_need_and_certificate_works(kind):
    spec = F.CERTIFICATE_KINDS[kind]
    options = F.estimate_options(kind)
    assert isinstance(options["per_coordinate"], bool)
    q, k, v, pi = _batch(np.random.default_rng(0))
    est = F.hajek_attention(q, k, v, pi, **options)
    for stat in spec.needs:
        assert getattr(est, stat) is not None, f"{kind}: estimate_options({kind!r}) = {options} leaves {stat} None"
    cert = F.certificate(est, delta=0.05, kind=kind)
    assert cert.kind == kind
    b, h_q, dv = est.output.shape
    assert cert.radius.shape == ((b, h_q, dv) if spec.per_coordinate else (b, h_q))
    assert cert.relative_radius.shape == (b, h_q) and cert.lower.shape == (b, h_q, dv)
    assert torch.isfinite(cert.radius).all() and (cert.radius > 0).all()
    # each option is really needed: without it the certificate refuses and names the option
    for option, on in options.items():
        if on:
            est = F.hajek_attention(q, k, v, pi, **{**options, option: False})
            with pytest.raises(ValueError, match=f"{option}=True"):
                F.certificate(est, delta=0.05, kind=kind)


def test_estimate_options_of_several_kinds_is_the_union():
    both = F.estimate_options(KIND_NAMES)
    assert both == F.estimate_options(reversed(KIND_NAMES)) == F.estimate_options(tuple(KIND_NAMES))
    for kind in KIND_NAMES:
        for option, on in F.estimate_options(kind).items():
            assert both[option] or not on
    assert both["per_coordinate"] == any(F.estimate_options(kind)["per_coordinate"] for kind in KIND_NAMES)
    assert set(both) == {o for kind in KIND_NAMES for o in F.estimate_options(kind)}
    assert F.estimate_options([]) == {"per_coordinate": False}
    # one estimate serves every kind
    q, k, v, pi = _batch(np.random.default_rng(1))
    est = F.hajek_attention(q, k, v, pi, **both)
    for kind in KIND_NAMES:
        assert torch.isfinite(F.certificate(est, kind=kind).radius).all()


@pytest.mark.parametrize("kind", KIND_NAMES)
@given(n=st.integers(1, 40), dv=st.sampled_from([1, 3, 8]), delta=st.sampled_from([0.01, 0.05, 0.3]),
       data=st.data())
def test_fast_radius_equals_reference_per_kind(kind, n, dv, delta, data):
    """Same approach as tests/test_fast_certificates.py, with the estimate asked for by estimate_options(kind)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 10**6)))
    b, h_kv, g = 2, 2, 2
    pi = torch.from_numpy(np.stack([np.stack([data.draw(pi_vectors(n)) for _ in range(h_kv)]) for _ in range(b)]))
    q, k, v, pi = _batch(rng, b=b, h_kv=h_kv, g=g, n=n, dv=dv, pi=pi)
    est = F.hajek_attention(q, k, v, pi, **F.estimate_options(kind))
    cert = F.certificate(est, delta=delta, kind=kind)
    assert_certificate_matches_reference(cert, q, k, v, pi, delta=delta, kind=kind)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_reference_covers_follows_per_coordinate(kind):
    rng = np.random.default_rng(2)
    est = R.hajek_attention(rng.normal(size=4), rng.normal(size=(12, 4)), rng.normal(size=(12, 3)),
                            np.full(12, 0.5))
    hit = R.covers(R.certificate(est, kind=kind), est, est.output)
    if R.CERTIFICATE_KINDS[kind].per_coordinate:
        assert hit.shape == (3,) and hit.all()
    else:
        assert hit is True


@pytest.mark.parametrize("bad", ["hoeffding", "", "WALD", None, 3, ["wald"]])
def test_unknown_kind_is_refused_naming_the_known_kinds(bad):
    names = list(F.CERTIFICATE_KINDS)

    def check(call):
        with pytest.raises(ValueError, match="kind must be one of") as e:
            call()
        assert all(repr(name) in str(e.value) for name in names), str(e.value)

    q, k, v, pi = _batch(np.random.default_rng(3), b=1, h_kv=1, g=1, n=6, dv=2)
    est = F.hajek_attention(q, k, v, pi, **F.estimate_options(names))
    check(lambda: F.certificate(est, kind=bad))
    check(lambda: F.radius_from_moments(bad, 0.05, trace=est.trace))
    check(lambda: F.estimate_options([bad] if not isinstance(bad, str) else bad))
    ref = R.hajek_attention(np.ones(2), np.ones((3, 2)), np.ones((3, 1)), np.full(3, 0.5))
    check(lambda: R.certificate(ref, kind=bad))
    check(lambda: R.radius_from_moments(bad, 0.05, trace=1.0))
