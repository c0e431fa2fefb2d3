"""The OpenAI-compatible server with the plugin, queried with the ``openai`` client (docs/serving.md,
"The OpenAI-compatible server" and "Metrics").

One server for the module, started by the users' one command, ``kvcert serve MODEL`` with :data:`SERVER_ARGS`
(docs/serving.md opens with it; it runs ``python -m vllm.entrypoints.openai.api_server`` with the plugin's
scheduler, worker and settings added, so every certified response below also shows that it did), engine default ``compression_ratio=0`` (evicts nothing unless a
request asks), on 127.0.0.1 and a free port, in the vLLM venv, from a temporary folder outside the
repository root, killed at teardown. Before it starts, one in-process engine (``certified_llm``, the same
engine settings) generates the reference for prompt 0 with the same request options.

One session of requests, in order, one at a time (so every request is alone in its batch): completions
(token-id prompt 0 of ``vllm_support.prompts()``, 193 tokens) certified and plain, streamed and not; chat
completions certified (streamed and not) and plain; one request with a bad option. What must hold: a
certified response's ``kv_transfer_params["kvcert"]["certificates"]`` has one entry per completion token
and equals the in-process ``kvcert.vllm.certificates(output)`` (and the tokens are the same); a streamed
response carries the record with the chunk that has the finish reason and no other chunk does; plain
responses carry none; the bad request finishes as aborted with the key named; ``/metrics`` counts exactly
the certified requests, their freed blocks and the histogram of their mean relative radius, computed
here from the responses.

The stat logger is found through the ``vllm.stat_logger_plugins`` entry point; where the installed kvcert
predates it, the test puts a folder declaring it on the server's PYTHONPATH (:func:`vllm_support.stat_logger_shim`).
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from vllm_support import BLOCK, SERVED_NAME, kvcert_serve_args, metric_samples, prompts, run_engine, serve


MAX_TOKENS = 4
SEED = 3
CERT = {"kvcert_compression_ratio": 0.5, "kvcert_seed": SEED}
MODEL = SERVED_NAME
#: the server's command line after ``kvcert serve MODEL`` (docs/serving.md)
SERVER_ARGS = kvcert_serve_args()
#: relative tolerance between the certificates of the same request in the server and in the in-process
#: engine: the same float32 arithmetic on the same prompt, each request alone in its batch, so equal up to
#: the blocking of the linear layers' products if the two engines chose different batch shapes (a few
#: eps32 = 1.2e-7 per layer, 30 layers: ~1e-5 at most; test_vllm_requests.py's bound)
CERT_RTOL = 1e-5
START_TIMEOUT = 600.0
REQUEST_TIMEOUT = 300.0
CHAT = [{"role": "user", "content": "Summarize this text in one word.\n" + " ".join(
    f"Item {i} is a word about serving." for i in range(20))}]


@pytest.fixture(scope="module")
def reference():
    """Prompt 0 certified in-process (certified_llm, engine default 0, the request's options)."""
    pytest.importorskip("openai")  # .venv-vllm has it (openai 3.60.0); without it no engine is started
    out = run_engine(plugin=True, compression_ratio=0.0, runs=[
        {"order": [0], "max_tokens": MAX_TOKENS, "extra_args": [CERT]}])
    return out["runs"][0]["outputs"]["0"]


@pytest.fixture(scope="module")
def server(reference):
    """Base URL of a running server (started after the in-process reference: one engine at a time)."""
    with serve(SERVER_ARGS, START_TIMEOUT, launcher="kvcert") as srv:
        yield srv


def _kvcert(obj) -> dict | None:
    params = (obj.model_extra or {}).get("kv_transfer_params") if hasattr(obj, "model_extra") else None
    return (params or {}).get("kvcert")


@pytest.fixture(scope="module")
def session(server):
    """Every request of the module, one at a time; the responses as plain data."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0,
                           timeout=REQUEST_TIMEOUT)
    prompt = list(prompts()[0])
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    cert = {"vllm_xargs": CERT, "ignore_eos": True, "return_token_ids": True}
    plain = {"ignore_eos": True, "return_token_ids": True}
    out = {}

    def completion(name, extra):
        r = client.completions.create(prompt=prompt, extra_body=extra, **common)
        out[name] = {"text": r.choices[0].text, "token_ids": r.choices[0].model_extra.get("token_ids"),
                     "completion_tokens": r.usage.completion_tokens, "kvcert": _kvcert(r)}

    def stream(name, extra, chat=False):
        create = client.chat.completions.create if chat else client.completions.create
        kw = {"messages": CHAT} if chat else {"prompt": prompt}
        chunks = list(create(stream=True, stream_options={"include_usage": True}, extra_body=extra, **kw,
                             **common))
        text = "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text
                       for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage is not None]
        out[name] = {"text": text, "completion_tokens": usage[-1].completion_tokens if usage else None,
                     "prompt_tokens": usage[-1].prompt_tokens if usage else None,
                     "finishing": [i for i, c in enumerate(chunks)
                                   if c.choices and c.choices[0].finish_reason is not None],
                     "carrying": [i for i, c in enumerate(chunks) if _kvcert(c) is not None],
                     "kvcert": next((_kvcert(c) for c in chunks if _kvcert(c) is not None), None),
                     "n_chunks": len(chunks)}

    def chat(name, extra):
        r = client.chat.completions.create(messages=CHAT, extra_body=extra, **common)
        out[name] = {"text": r.choices[0].message.content, "completion_tokens": r.usage.completion_tokens,
                     "prompt_tokens": r.usage.prompt_tokens, "kvcert": _kvcert(r)}

    completion("completion", cert)
    completion("completion_plain", plain)
    stream("completion_stream", cert)
    stream("completion_stream_plain", plain)
    chat("chat", {"vllm_xargs": CERT, "ignore_eos": True})
    stream("chat_stream", {"vllm_xargs": CERT, "ignore_eos": True}, chat=True)
    chat("chat_plain", {"ignore_eos": True})
    r = client.completions.create(prompt=prompt, extra_body={"vllm_xargs": {"kvcert_compression_ratio": 1.5}},
                                  **common)
    out["bad"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                  "completion_tokens": r.usage.completion_tokens, "kvcert": _kvcert(r)}
    return out


CERTIFIED = ("completion", "completion_stream", "chat", "chat_stream")
PLAIN = ("completion_plain", "completion_stream_plain", "chat_plain")


def _check_certificates(name, rec, n_tokens):
    assert rec is not None, f"{name}: no kv_transfer_params['kvcert']"
    c = np.asarray(rec["certificates"], dtype=np.float64)
    assert c.shape == (n_tokens,), f"{name}: {c.shape} certificates for {n_tokens} completion tokens"
    assert np.isfinite(c).all() and c[0] == 0.0 and (c[1:] > 0).all(), f"{name}: {c}"
    assert rec["granularity"] == "token" and rec["evicted"] > 0 and rec["blocks_freed"] > 0, name
    assert rec["preempted"] is False, name
    return c


@pytest.mark.slow
@pytest.mark.model
def test_certified_completion_equals_the_in_process_engine(session, reference):
    r = session["completion"]
    c = _check_certificates("completion", r["kvcert"], MAX_TOKENS)
    assert r["completion_tokens"] == MAX_TOKENS
    assert r["token_ids"] == reference["token_ids"]
    ref = reference["report"]
    for key in ("kept_counts", "m", "n_prompt_tokens", "evicted", "blocks_freed"):
        assert r["kvcert"][key] == ref[key], key
    cr = np.asarray(reference["certificates"])
    print(f"certificates: server {c.tolist()}\n              in-process {cr.tolist()}\n"
          f"worst relative difference {float(np.abs(c[1:] / cr[1:] - 1).max()):.2e} (tolerance {CERT_RTOL:g})")
    np.testing.assert_allclose(c, cr, rtol=CERT_RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.model
def test_streamed_completion_carries_the_record_with_its_final_chunk(session):
    s, r = session["completion_stream"], session["completion"]
    assert s["text"] == r["text"] and s["completion_tokens"] == MAX_TOKENS
    assert len(s["finishing"]) == 1 and s["carrying"] == s["finishing"], s
    assert s["carrying"][0] < s["n_chunks"] - 1  # the usage chunk follows and carries none
    c = _check_certificates("completion_stream", s["kvcert"], MAX_TOKENS)
    np.testing.assert_allclose(c, r["kvcert"]["certificates"], rtol=CERT_RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.model
def test_chat_completions_certified_streamed_and_not(session):
    from kvcert.vllm.config import KVCertConfig

    a, s = session["chat"], session["chat_stream"]
    assert KVCertConfig(compression_ratio=0.5).evicts(a["prompt_tokens"], BLOCK), a["prompt_tokens"]
    assert a["completion_tokens"] == s["completion_tokens"] == MAX_TOKENS
    assert a["text"] == s["text"]
    ca = _check_certificates("chat", a["kvcert"], MAX_TOKENS)
    assert s["carrying"] == s["finishing"] and len(s["finishing"]) == 1, s
    cs = _check_certificates("chat_stream", s["kvcert"], MAX_TOKENS)
    np.testing.assert_allclose(cs, ca, rtol=CERT_RTOL, atol=0)
    assert a["kvcert"]["n_prompt_tokens"] == a["prompt_tokens"]
    print(f"chat: {a['prompt_tokens']} prompt tokens, {a['kvcert']['blocks_freed']} blocks freed, "
          f"certificates {ca.tolist()}")


@pytest.mark.slow
@pytest.mark.model
def test_plain_requests_carry_no_certificates(session):
    for name in PLAIN:
        assert session[name]["kvcert"] is None, name
        assert session[name]["completion_tokens"] == MAX_TOKENS, name
    assert session["completion_stream_plain"]["carrying"] == []
    assert len(session["completion_plain"]["token_ids"]) == MAX_TOKENS


@pytest.mark.slow
@pytest.mark.model
def test_a_bad_option_fails_its_request_with_the_key_named(session):
    bad = session["bad"]
    assert bad["finish_reason"] == "abort" and bad["completion_tokens"] == 0 and bad["text"] == ""
    assert set(bad["kvcert"]) == {"error"} and "kvcert_compression_ratio" in bad["kvcert"]["error"], bad
    print(bad["kvcert"]["error"])


def _metrics(url: str) -> dict:
    out = {}
    for s in metric_samples(url):
        if s.name.startswith("kvcert_") and s.labels.get("model_name") == MODEL:
            le = s.labels.get("le")
            out[s.name if le is None else (s.name, le)] = s.value
    return out


@pytest.mark.slow
@pytest.mark.model
def test_metrics_count_the_certified_requests(server, session):
    from kvcert.vllm.metrics import RADIUS_BUCKETS, radius_bucket

    recs = [session[n]["kvcert"] for n in CERTIFIED]
    means = [float(np.mean(r["certificates"])) for r in recs]
    want = {"kvcert_requests_certified_total": len(recs),
            "kvcert_requests_evicted_total": len(recs),
            "kvcert_blocks_freed_total": sum(r["blocks_freed"] for r in recs),
            "kvcert_tokens_evicted_total": sum(r["evicted"] for r in recs),
            "kvcert_certified_requests_preempted_total": sum(r["preempted"] for r in recs),
            "kvcert_requests_refused_total": 1,
            "kvcert_mean_relative_radius_count": len(recs)}
    # the stat logger records after the engine's step; poll briefly for the last request's step
    deadline = time.monotonic() + 60
    while True:
        got = _metrics(server["url"])
        if got.get("kvcert_requests_certified_total") == len(recs) or time.monotonic() > deadline:
            break
        time.sleep(1)
    print("shim" if server["shim"] else "installed entry point", {k: v for k, v in got.items()
                                                                   if not isinstance(k, tuple)})
    for name, value in want.items():
        assert got.get(name) == value, f"{name}: /metrics {got.get(name)}, responses {value}"
    # the sum travels in units of 1e-9, rounded once (0.5e-9) on top of float64 rounding of a few terms
    assert math.isclose(got["kvcert_mean_relative_radius_sum"], sum(means), rel_tol=0, abs_tol=1e-8)
    counts = np.bincount([radius_bucket(m) for m in means], minlength=len(RADIUS_BUCKETS) + 1)
    for bound, cum in zip([*map(str, RADIUS_BUCKETS), "+Inf"], np.cumsum(counts)):
        assert got[("kvcert_mean_relative_radius_bucket", bound)] == cum, bound


# ---------------------------------------------------------------------------------------------- no engine


def test_stats_round_trip_through_the_scheduler_stats_dict():
    from kvcert.vllm.metrics import COUNTERS, RADIUS_BUCKETS, encode_stats, radius_bucket, take_stats

    assert [radius_bucket(v) for v in (0.0, 0.01, 0.0100001, 10.0, 10.5)] == [0, 0, 1, len(RADIUS_BUCKETS) - 1,
                                                                               len(RADIUS_BUCKETS)]
    counts = list(range(len(RADIUS_BUCKETS) + 1))
    payload = {"lora-a": 2, **encode_stats({"blocks_freed": 7, "requests_certified": 3, "other": 9}, counts,
                                           1.2345678912)}
    got = take_stats(payload)
    assert payload == {"lora-a": 2}  # the plugin's keys are removed, a LoRA adapter's stay
    assert got["counters"] == {**{k: 0 for k in COUNTERS}, "blocks_freed": 7, "requests_certified": 3}
    assert got["buckets"] == counts
    assert abs(got["sum"] - 1.2345678912) <= 0.5e-9  # one rounding to 1e-9
    assert take_stats({"lora-a": 1}) is None
    with pytest.raises(ValueError, match="radius_counts"):
        encode_stats({}, [0], 0.0)


def _fake_stream(results, finishing_chunk=True):
    """A stand-in for vLLM's completion stream generator: one chunk per output, then [DONE]."""
    from types import SimpleNamespace as NS

    class Serving:
        async def completion_stream_generator(self, request, engine_inputs, result_generator, request_id):
            async for prompt_idx, res in result_generator:
                for out in res.outputs:
                    choice = {"index": out.index + prompt_idx, "text": "x"}
                    if out.finish_reason is not None and finishing_chunk:
                        choice["finish_reason"] = out.finish_reason
                    yield "data: " + json.dumps({"id": request_id, "choices": [choice]}) + "\n\n"
            yield "data: [DONE]\n\n"

    def output(finish, params):
        return NS(finished=finish is not None, kv_transfer_params=params,
                  outputs=[NS(index=0, finish_reason=finish)])

    async def gen():
        for i, item in enumerate(results):
            yield (i // 2, output(*item))

    return Serving, NS(n=1), gen


def _chunks(lines):
    return [None if line.startswith("data: [DONE]") else json.loads(line[6:]) for line in lines]


def test_stream_wrapper_puts_the_record_on_the_finishing_chunk():
    import asyncio

    from kvcert.vllm.metrics import _with_transfer_params

    record = {"kvcert": {"certificates": [0.0, 0.5]}}
    results = [(None, None), ("length", {**record, "remote_block_ids": [1]}),  # prompt 0: kvcert + a connector's
               (None, None), ("stop", {"remote_block_ids": [2]})]  # prompt 1: a connector's only
    Serving, request, gen = _fake_stream(results)
    wrapped = _with_transfer_params(Serving.completion_stream_generator, results_at=1, indexed=True,
                                    obj="text_completion")

    async def run():
        return [line async for line in wrapped(Serving(), request, [], gen(), "cmpl-1")]

    chunks = _chunks(asyncio.run(run()))
    assert [("kv_transfer_params" in c) if c else None for c in chunks] == [False, True, False, False, None]
    assert chunks[1]["kv_transfer_params"] == record and chunks[1]["choices"][0]["finish_reason"] == "length"


def test_stream_wrapper_sends_an_unsent_record_before_done():
    import asyncio

    from kvcert.vllm.metrics import _with_transfer_params

    record = {"kvcert": {"certificates": [0.0]}}
    Serving, request, gen = _fake_stream([(None, None), ("length", record)], finishing_chunk=False)
    wrapped = _with_transfer_params(Serving.completion_stream_generator, results_at=1, indexed=True,
                                    obj="text_completion")

    async def run():
        return [line async for line in wrapped(Serving(), request, [], gen(), "cmpl-2")]

    chunks = _chunks(asyncio.run(run()))
    assert chunks[-1] is None and chunks[-2] == {"object": "text_completion", "choices": [],
                                                 "kv_transfer_params": record}
    assert all("kv_transfer_params" not in c for c in chunks[:-2])
