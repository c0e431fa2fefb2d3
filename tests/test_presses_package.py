"""kvcert.presses as a package: one explicit class per built-in scorer press, the registry-made press of a
scorer registered at run time, and the public names of the package.

Each built-in scorer of ``kvcert.fast.SCORERS`` has a hand-written dataclass (``class SnapKVPress`` in
``kvcert/presses/snapkv_press.py``) whose fields, defaults, validation, kvpress aliases and score are
those of the press :func:`kvcert.presses.make_scorer_press` makes from the registry entry; a scorer
registered later still gets a press (``kvcert.<Scorer.press>``), checked in a fresh interpreter so the
registry of this session stays as it is.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcert
import kvcert.presses as P
from kvcert.fast import SCORERS

BUILTIN = sorted(SCORERS)  # the registry of a fresh session: the built-in scorers only
COMMON = [f.name for f in dataclasses.fields(P.BasePress)]
#: the public names of the module before it became a package (PRESS_CASES moved to tests/press_cases.py)
PUBLIC = ["Press", "BasePress", "ScorerPress", "PoissonPress", "BlockPoissonPress", "BlockDecision", "DecodingPress",
          "PRESSES", "SCORER_NAMES", "make_scorer_press", "KVPRESS_NAMES", "SKETCHES", "SCORER_PARAMS"]
#: hyperparameter values other than every registered default (and odd ones for the validation test)
OTHER = {"observation_window": 3, "kernel_size": 3, "pooling": "kvpress", "head_pooling": "all", "seed": 4,
         "lag_size": 2, "n_sink": 2}
PROBES = [-1, 0, 1, 2, 3, 4, 1.5, True, None, "x", "kvpress", "replicate", "all", "group"]


def _own(cls) -> list[dataclasses.Field]:
    """The fields a press class adds to BasePress's."""
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields[:len(COMMON)]] == COMMON
    return list(fields[len(COMMON):])


def _inputs(name: str, *, n: int = 40, seed: int = 0):
    """(queries, keys, values): b 2, 4 query heads over 2 KV heads, d 8; one query per key for an all-query
    scorer, else a window of 8."""
    gen = torch.Generator().manual_seed(seed)
    w = n if SCORERS[name].queries == "all" else 8
    q = torch.randn(2, 4, w, 8, generator=gen)
    k = torch.randn(2, 2, n, 8, generator=gen)
    v = torch.randn(2, 2, n, 8, generator=gen)
    return q, k, v


@pytest.mark.parametrize("name", BUILTIN)
def test_every_builtin_scorer_has_an_explicit_press(name):
    scorer = SCORERS[name]
    cls = P.PRESSES[name]
    assert cls.__name__ == scorer.press and getattr(kvcert, scorer.press) is cls and getattr(P, scorer.press) is cls
    assert issubclass(cls, P.ScorerPress) and cls.scorer_name == name
    # written out as a class statement in a module of the package (what `grep "class SnapKVPress"` finds)
    source = Path(inspect.getsourcefile(cls))
    assert source.parent == Path(P.__file__).parent and source.name != "__init__.py"
    assert f"class {scorer.press}(" in source.read_text()
    assert "score" in vars(cls)  # its own score
    # fields: observation_window if it reads a query window, then the scorer's params with their defaults
    window_default = {f.name: f.default for f in dataclasses.fields(kvcert.PoissonPress)}["observation_window"]
    want = {**({"observation_window": window_default} if scorer.queries == "window" else {}), **scorer.params}
    assert [(f.name, f.default) for f in _own(cls)] == list(want.items())
    assert cls().query_need == scorer.queries


@pytest.mark.parametrize("name", BUILTIN)
def test_explicit_press_is_the_registry_made_press(name):
    """Same fields, defaults, constructor (kvpress aliases included), MRO shape and repr as the class
    make_scorer_press builds from the registry entry."""
    cls, made = P.PRESSES[name], P.make_scorer_press(name)
    assert made is not cls and made.__name__ == cls.__name__
    assert [(f.name, f.default) for f in dataclasses.fields(cls)] == [
        (f.name, f.default) for f in dataclasses.fields(made)]
    sig = inspect.signature(cls.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in sig.values()] == [
        (p.name, p.kind, p.default) for p in inspect.signature(made.__init__).parameters.values()]
    assert [c.__name__ for c in cls.__mro__] == [c.__name__ for c in made.__mro__]
    aliases = sorted(a for a in P.KVPRESS_NAMES if isinstance(inspect.getattr_static(cls, a, None), property))
    assert aliases == sorted(a for a in P.KVPRESS_NAMES if isinstance(inspect.getattr_static(made, a, None), property))
    assert repr(cls()) == repr(made()) and cls().query_need == made().query_need
    for alias, field in P.KVPRESS_NAMES.items():
        if alias in aliases:
            assert getattr(cls(**{alias: 5}), field) == 5 == getattr(made(**{alias: 5}), field)


def _outcome(cls, kwargs):
    try:
        press = cls(**kwargs)
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)
    return "ok", {k: getattr(press, k) for k in kwargs}


@pytest.mark.parametrize("name", BUILTIN)
def test_explicit_press_validates_as_the_registry_made_press(name):
    cls, made = P.PRESSES[name], P.make_scorer_press(name)
    fields = [f.name for f in _own(cls)]
    rejected = 0
    for field in fields:
        for value in PROBES:
            got, want = _outcome(cls, {field: value}), _outcome(made, {field: value})
            assert got == want, (field, value)
            rejected += got[0] != "ok"
    assert rejected >= 3 * len(fields)  # the probes hit every field's check


@pytest.mark.parametrize("name", BUILTIN)
def test_explicit_press_scores_with_its_fields(name):
    """score is the registered scorer called with the press's hyperparameters: equal to the registry
    call at the defaults and at other values, and the other values change the score."""
    scorer = SCORERS[name]
    q, k, v = _inputs(name)
    cls = P.PRESSES[name]
    other = {p: OTHER[p] for p in scorer.params}
    for kwargs in ({}, other):
        press = cls(**kwargs)
        u = press.score(q, k, v, scale=0.3, layer=1, event=2)
        want = scorer(q, k, v, scale=0.3, layer=1, event=2, **kwargs)
        assert u.shape == (2, 2, 40) and torch.equal(u, want)
        assert torch.equal(u, P.make_scorer_press(name)(**kwargs).score(q, k, v, scale=0.3, layer=1, event=2))
    if other:
        assert not torch.equal(cls().score(q, k, v, scale=0.3, layer=1, event=2),
                               cls(**other).score(q, k, v, scale=0.3, layer=1, event=2))


def test_presses_maps_every_name_and_the_public_names_stay():
    assert set(P.PRESSES) == {"poisson", *SCORERS} and P.PRESSES["poisson"] is kvcert.PoissonPress
    assert P.SCORER_NAMES == tuple(SCORERS)
    assert set(P.__all__) == (set(PUBLIC) - {"SKETCHES", "SCORER_PARAMS"}) | {s.press for s in SCORERS.values()}
    for name in PUBLIC:
        assert hasattr(P, name), name
    for name in P.__all__:
        if name in kvcert._LAZY:
            assert getattr(kvcert, name) is getattr(P, name), name
    # the test data is not public API
    assert not hasattr(P, "PRESS_CASES") and "PRESS_CASES" not in kvcert._LAZY
    with pytest.raises(AttributeError):
        kvcert.PRESS_CASES  # noqa: B018
    with pytest.raises(AttributeError, match="NoSuchPress"):
        P.NoSuchPress  # noqa: B018
    with pytest.raises(AttributeError, match="NoSuchPress"):
        kvcert.NoSuchPress  # noqa: B018


_LATE = r"""
import json, pickle, sys
import torch
import kvcert
from kvcert.fast import Scorer, register_scorer

order = sys.argv[1]
sys.path.insert(0, sys.argv[2])  # the tests folder (model_fixtures)
if order == "after":
    import kvcert.presses  # the package exists before the scorer does


def norm_power(q, k, v, *, power, **_):
    return torch.linalg.vector_norm(k, dim=-1) ** power


register_scorer(Scorer("norm_power", norm_power, "none", "NormPowerPress", {"power": 2}, "Key norm to a power."))
import kvcert.presses as P
from model_fixtures import forced_logits, tiny_model

cls = kvcert.NormPowerPress
out = {"same": cls is P.NormPowerPress is P.PRESSES["norm_power"],
       "scorer_press": issubclass(cls, kvcert.ScorerPress), "module": cls.__module__,
       "fields": [(f.name, f.default) for f in __import__("dataclasses").fields(cls)][-1:],
       "in_all": "NormPowerPress" in P.__all__, "query_need": cls().query_need}
try:
    cls(power=0)
except ValueError as err:
    out["power0"] = str(err)
press = cls(compression_ratio=0.5, sinks=2, window=4, power=3)
out["roundtrip"] = pickle.loads(pickle.dumps(press)) == press
k = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(0))
out["score"] = torch.equal(press.score(None, k, k, scale=0.3), torch.linalg.vector_norm(k, dim=-1) ** 3)


class Manual(kvcert.ScorerPress):  # the same method, written by hand
    query_need = "none"

    def score(self, queries, keys, values, *, scale, layer=0, event=0):
        return torch.linalg.vector_norm(keys, dim=-1) ** 3


model = tiny_model()
ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(1))
cont = torch.tensor([[5], [7], [9]])
logits, _ = forced_logits(model, ids, cont, press)
manual = Manual(compression_ratio=0.5, sinks=2, window=4)
logits_manual, _ = forced_logits(model, ids, cont, manual)
full, _ = forced_logits(model, ids, cont)
c = press.certificates
out["decode"] = {"same_as_manual": torch.equal(logits, logits_manual), "differs_from_full": not torch.equal(logits, full),
                 "kept": int(c.kept[:, -1].max()), "radius0": bool((c.radius == 0).all())}
poisson = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4, scorer="norm_power", seed=0)
forced_logits(model, ids, cont, poisson)
out["poisson_radius"] = float(poisson.certificates.radius[:, 1:].max())
print(json.dumps(out))
"""


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_scorer_registered_at_run_time_gets_a_press(order, tmp_path):
    """A scorer registered before or after ``import kvcert.presses``: ``kvcert.<Scorer.press>`` is its
    press (made from the registry entry, listed in PRESSES, picklable); it decodes as the same method
    written by hand as a ScorerPress, and PoissonPress samples by it. Run in a fresh interpreter."""
    # run outside the repository root, whose kernels/ folder would shadow transformers' `kernels`
    run = subprocess.run([sys.executable, "-c", _LATE, order, str(Path(__file__).parent)], capture_output=True,
                         text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["same"] and out["scorer_press"] and out["module"] == "kvcert.presses"
    assert out["fields"] == [["power", 2]] and out["query_need"] == "none"
    assert out["in_all"] == (order == "before")  # __all__ lists the presses made at import
    assert "power must be >= 1" in out["power0"]
    assert out["roundtrip"] and out["score"]
    decode = out["decode"]
    assert decode["same_as_manual"] and decode["differs_from_full"] and decode["radius0"]
    assert decode["kept"] < 40  # the prefill of 40 tokens was compressed (then a few decoded tokens joined)
    assert out["poisson_radius"] > 0
