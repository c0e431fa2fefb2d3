"""One input contract for ``hajek_attention`` (kvcert.fast.contract), the same in every backend.

Each bad input goes to every entry point that runs here: kvcert.fast, the Triton kernel
(under TRITON_INTERPRET=1 on CPU, as tests/test_kernels_hajek.py; the contract is checked before
anything needs CUDA) and kvcert.dispatch with each backend it can run on CPU. All must raise
the same exception type with a message naming the argument; where the shared checker raised
it, the message is the same text everywhere. A new case is one line in ``CASES``.
"""

from __future__ import annotations

import math
import re
from functools import partial
from typing import Callable, NamedTuple

import pytest
import torch

import kvcert.fast as F
from kvcert import dispatch as D
from kvcert.fast.contract import check_attention_inputs
from support import EPS, assert_close, field_scale, rounding


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv(D.ENV_VAR, raising=False)


def _entry_points() -> list[tuple[str, Callable, bool]]:
    """(name, function, runs valid CPU input): the kernel refuses bad input before it needs CUDA."""
    eps = [("fast", F.hajek_attention, True),
           ("dispatch[fast]", partial(D.hajek_attention, backend="fast"), True),
           ("dispatch[reference]", partial(D.hajek_attention, backend="reference"), True)]
    if D.triton_available():
        from kvcert import kernels

        eps.append(("kernels", kernels.hajek_attention, kernels.INTERPRETED))
        if kernels.INTERPRETED:  # (forced "triton" on CPU tensors otherwise says BackendUnavailable first)
            eps.append(("dispatch[triton]", partial(D.hajek_attention, backend="triton"), True))
    return eps


ENTRY_POINTS = _entry_points()
#: entry points with a check of their own before the shared one (the kernel takes decode q only)
_KERNEL = frozenset({"kernels", "dispatch[triton]"})


def _good() -> dict:
    """A valid decode call on CPU, float32 (every backend's dtype): b=1, h_q=4, h_kv=2, n=5, d=16, dv=8."""
    gen = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(1, 4, 16, generator=gen), keys=torch.randn(1, 2, 5, 16, generator=gen),
                values=torch.randn(1, 2, 5, 8, generator=gen),
                pi=torch.rand(1, 2, 5, generator=gen) * 0.9 + 0.05)


class Case(NamedTuple):
    id: str
    mutate: Callable[[dict], dict]
    exc: type
    argument: str  # the word the message must contain
    own_check: frozenset = frozenset()  # entry points allowed their own (earlier) message


def _log(a: dict, log_pi) -> dict:
    return dict(a, pi=None, log_pi=log_pi)


CASES = [
    Case("q-not-tensor", lambda a: dict(a, q=a["q"].numpy()), TypeError, "q"),
    Case("q-integer", lambda a: dict(a, q=a["q"].long()), TypeError, "q"),
    Case("q-2d", lambda a: dict(a, q=a["q"][0]), ValueError, "q", _KERNEL),
    Case("keys-not-tensor", lambda a: dict(a, keys=a["keys"].numpy()), TypeError, "keys"),
    Case("keys-3d", lambda a: dict(a, keys=a["keys"][0]), ValueError, "keys"),
    Case("keys-wrong-d", lambda a: dict(a, keys=a["keys"][..., :8]), ValueError, "keys"),
    Case("keys-wrong-b", lambda a: dict(a, keys=a["keys"].expand(2, 2, 5, 16)), ValueError, "keys"),
    Case("values-not-tensor", lambda a: dict(a, values=[1.0]), TypeError, "values"),
    Case("values-wrong-n", lambda a: dict(a, values=a["values"][:, :, :4]), ValueError, "values"),
    Case("values-integer", lambda a: dict(a, values=a["values"].long()), TypeError, "values"),
    Case("gqa-mismatch", lambda a: dict(a, q=a["q"][:, :3]), ValueError, "h_kv"),
    Case("zero-head-dim", lambda a: dict(a, q=a["q"][..., :0], keys=a["keys"][..., :0]), ValueError, "d"),
    Case("pi-missing", lambda a: dict(a, pi=None), TypeError, "pi"),
    Case("pi-and-log_pi", lambda a: dict(a, log_pi=torch.log(a["pi"])), TypeError, "log_pi"),
    Case("pi-not-tensor", lambda a: dict(a, pi=a["pi"].numpy()), TypeError, "pi"),
    Case("pi-wrong-shape", lambda a: dict(a, pi=a["pi"][..., :4]), ValueError, "pi"),
    Case("pi-integer", lambda a: dict(a, pi=(a["pi"] > 2).long()), TypeError, "pi"),
    Case("pi-other-device", lambda a: dict(a, pi=a["pi"].to("meta")), ValueError, "pi"),
    Case("pi-above-1", lambda a: dict(a, pi=a["pi"] + 1.5), ValueError, "pi"),
    Case("pi-negative", lambda a: dict(a, pi=a["pi"] - 2.0), ValueError, "pi"),
    Case("pi-nan", lambda a: dict(a, pi=a["pi"].masked_fill(a["pi"] > 0.5, math.nan)), ValueError, "pi"),
    Case("log_pi-positive", lambda a: _log(a, torch.ones(1, 2, 5)), ValueError, "log_pi"),
    Case("log_pi-nan", lambda a: _log(a, torch.full((1, 2, 5), math.nan)), ValueError, "log_pi"),
    Case("log_pi-wrong-shape", lambda a: _log(a, torch.zeros(1, 2, 6)), ValueError, "log_pi"),
    Case("scale-negative", lambda a: dict(a, scale=-1.0), ValueError, "scale"),
    Case("scale-zero", lambda a: dict(a, scale=0.0), ValueError, "scale"),
    Case("scale-nan", lambda a: dict(a, scale=math.nan), ValueError, "scale"),
    Case("scale-inf", lambda a: dict(a, scale=math.inf), ValueError, "scale"),
    Case("scale-str", lambda a: dict(a, scale="0.25"), TypeError, "scale"),
    Case("scale-bool", lambda a: dict(a, scale=True), TypeError, "scale"),
]


def test_case_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_entry_point_refuses_alike(case: Case):
    raised = {}
    for name, fn, _ in ENTRY_POINTS:
        args = case.mutate(_good())
        with pytest.raises(Exception) as e:
            fn(**args)
        raised[name] = e.value
    for name, err in raised.items():
        assert type(err) is case.exc, f"{name}: {type(err).__name__}: {err}"
        assert re.search(rf"\b{re.escape(case.argument)}\b", str(err)), f"{name}: {err}"
    shared = {str(err) for name, err in raised.items() if name not in case.own_check}
    assert len(shared) == 1, {name: str(err) for name, err in raised.items()}


def test_negative_scale_is_refused_where_a_positive_one_runs():
    """The one scale rule: finite and positive (the kernel used to accept -1.0)."""
    a = _good()
    for name, fn, runs in ENTRY_POINTS:
        if runs:
            fn(**a, scale=0.25)
        with pytest.raises(ValueError, match="scale must be a finite positive float, got -0.25"):
            fn(**a, scale=-0.25)


def test_kernel_value_checks_stay_behind_validate():
    """validate=False skips only the checks that read tensors (a device sync); shapes are always checked."""
    pytest.importorskip("triton")
    from kvcert import kernels

    if not kernels.INTERPRETED:
        pytest.skip("runs the kernel on CPU: needs TRITON_INTERPRET=1")
    a = _good()
    est = kernels.hajek_attention(**dict(a, pi=a["pi"].clamp(max=1.0)), validate=False)
    assert est.output.shape == (1, 4, 8)
    kernels.hajek_attention(**dict(a, pi=a["pi"] + 1.5), validate=False)  # not read: no error
    with pytest.raises(ValueError, match="pi must have shape"):
        kernels.hajek_attention(**dict(a, pi=a["pi"][..., :4]), validate=False)
    with pytest.raises(ValueError, match="scale must be a finite positive"):
        kernels.hajek_attention(**a, scale=-1.0, validate=False)


def test_layout_of_decode_and_multi_query_calls():
    a = _good()
    L = check_attention_inputs(a["q"], a["keys"], a["values"], a["pi"])
    assert (L.b, L.h_q, L.h_kv, L.g, L.t, L.n, L.d, L.dv) == (1, 4, 2, 2, None, 5, 16, 8)
    assert L.decode and L.bias_shape == (1, 4, 5) and L.p is a["pi"] and L.p_name == "pi"
    assert L.scale == 1.0 / math.sqrt(16)
    q4 = torch.randn(1, 4, 3, 16)
    L = check_attention_inputs(q4, a["keys"], a["values"], log_pi=torch.log(a["pi"]), scale=0.5)
    assert not L.decode and L.t == 3 and L.bias_shape == (1, 4, 3, 5) and L.p_name == "log_pi" and L.scale == 0.5
    L = check_attention_inputs(a["q"], a["keys"], a["values"], probabilities=False)
    assert L.p is None and L.p_name is None
    with pytest.raises(ValueError, match="pi must lie in"):
        check_attention_inputs(a["q"], a["keys"], a["values"], a["pi"] + 1.5, validate=True)
    check_attention_inputs(a["q"], a["keys"], a["values"], a["pi"] + 1.5)  # validate=False: shapes only


@pytest.mark.parametrize("kw, exc, words", [
    (dict(bias=torch.zeros(3, 5)), ValueError, "bias must broadcast"),
    (dict(bias=torch.zeros(2, 1, 4, 5)), ValueError, "bias must broadcast"),
    (dict(bias=torch.full((1, 4, 5), math.inf)), ValueError, "bias must not contain NaN or +inf"),
    (dict(bias=[0.0] * 5), TypeError, "bias must be a torch.Tensor"),
    (dict(positions=torch.zeros(1, 2, 5, dtype=torch.int64)), TypeError, "needs query_positions"),
    (dict(positions=torch.zeros(1, 2, 4, dtype=torch.int64), offset=0), ValueError, "positions must have shape"),
    (dict(query_positions=torch.arange(3)), ValueError, "query_positions must have shape"),
    (dict(query_positions=torch.arange(1), offset=0), TypeError, "at most one of"),
    (dict(offset=1.5), TypeError, "offset must be an int"),
])
@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_mask_arguments_alike_in_fast_and_reference(backend, kw, exc, words):
    """bias / positions / query_positions / offset: the kvcert.fast options the reference loop also takes."""
    with pytest.raises(exc) as e:
        D.hajek_attention(**_good(), backend=backend, **kw)
    assert words in str(e.value)


def test_decode_bias_broadcasts_per_query_head_in_reference_too():
    """A (h_q, n) bias with a decode q broadcasts to (b, h_q, n) in every backend (the reference loop
    used to align it with (b, h_q, t=1, n) and read row 0 for every head)."""
    a = {k: x.double() for k, x in _good().items()}  # float64 in both: they agree to rounding
    bias = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fast = D.hajek_attention(**a, bias=bias, backend="fast")
    ref = D.hajek_attention(**a, bias=bias, backend="reference")
    assert torch.allclose(fast.output, ref.output, rtol=1e-12, atol=1e-12)
    for f in ("lse", "trace"):
        # the reference loop packs these in float32: one rounding (half an ulp, relative: a cast), on top of
        # the float64 sums of n = 5 terms taken in another order, against the field's scale (|lse| may be
        # near 0: the float64 part is absolute there)
        got, want = getattr(fast, f).numpy(), getattr(ref, f).double().numpy()
        tol = 0.5 * EPS[torch.float32] * abs(want) + 2 * rounding(torch.float64, 5) * field_scale(f, want)
        assert_close(f, got, want, tol)
        with pytest.raises(AssertionError):  # negative control: 20 units of that tolerance
            assert_close(f, got + 20 * tol, want, tol)
