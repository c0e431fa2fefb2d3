"""benchmarks/capacity_model.py: the capacity model's arithmetic, its validation against the CPU setting the
repository measured (benchmarks/serving_*.json), its negative controls and its refusals.

The validation's claim: the requests at once the block arithmetic predicts equal the measured ones up to the
output's block rounding (:func:`admission_band`'s derivation), and a model that drops the block rounding,
charges the worker's state to vLLM's pool, or drops the prefill's reserve predicts counts the runs did not see.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shlex
import struct
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("capacity_model", ROOT / "benchmarks" / "capacity_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


cm = _load()
M8, M70, SMOL = cm.MODELS["llama-3.1-8b"], cm.MODELS["llama-3.1-70b"], cm.MODELS["smollm2-135m"]
H100, H200 = cm.GPUS["h100"], cm.GPUS["h200"]


@pytest.fixture(scope="module")
def validation():
    return cm.validate_cpu()


# --------------------------------------------------------------------------------------------- presets

def test_preset_parameter_counts():
    """The shapes give the published counts (Llama-3.1: 8,030,261,248 and 70,553,706,496) and the default model's
    134,515,008 (what kvcert.load_model()'s model counts)."""
    assert (M8.params, M70.params, SMOL.params) == (8_030_261_248, 70_553_706_496, 134_515_008)
    assert (M8.layers, M8.kv_heads, M8.head_dim) == (32, 8, 128)
    assert (M70.layers, M70.kv_heads, M70.head_dim) == (80, 8, 128)
    assert M8.kv_bytes_per_token == 131_072  # 2 x 32 x 8 x 128 x 2 bytes: a block of 16 is 2 MiB


def test_smollm2_preset_matches_the_converted_model():
    """The SmolLM2 preset against the config and the tensor shapes of the folder kvcert.load_model() reads
    (the safetensors header only; skipped where the model was never converted)."""
    try:
        from kvcert.models import default_model_folder

        folder = default_model_folder()
        config = json.loads((folder / "config.json").read_text())
        with open(folder / "model.safetensors", "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    except Exception as error:  # noqa: BLE001 - no converted model on this machine
        pytest.skip(f"the default model's folder is not there: {error}")
    header.pop("__metadata__", None)
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == \
        (SMOL.layers, SMOL.kv_heads, SMOL.head_dim)
    assert sum(math.prod(t["shape"]) for t in header.values()) == SMOL.params


def test_sketch_size_is_the_documented_one():
    """2,209 elements per (layer, KV head) at d = dv = 64, 17.1 kept tokens, 795 KB per request (docs/serving.md)."""
    kv = cm.Kvcert()
    assert kv.sketch_elements(64, 64) == 2209 and round(kv.sketch_tokens(64, 64), 1) == 17.1
    assert cm.state_bytes(SMOL, dataclasses.replace(kv, sketch_copies=1), 0) == 795_240
    assert cm.Kvcert(sketch="none").sketch_elements(64, 64) == 0


# --------------------------------------------------------------------------------------------- arithmetic

@pytest.mark.parametrize("bs, prefill, run, stock_run", [(64, 16, 9, 17), (32, 32, 17, 33)])
def test_request_blocks_of_the_cpu_runs(bs, prefill, run, stock_run):
    """A 1k prompt and 32 tokens: the whole prompt in prefill, then m = ceil(ceil(512 - 17.1) / bs) compacted
    blocks plus the output's block (docs/serving.md: 8 + 1 = 9 against stock's 17 at blocks of 64)."""
    tokens = cm.Kvcert().sketch_tokens(64, 64)
    cert = cm.request_blocks(1024, 32, bs, ratio=0.5, sketch_tokens=tokens)
    assert (cert["prefill"], cert["run"], cert["kept"], cert["freed"]) == (prefill, run, 495, prefill - run + 1)
    assert cm.request_blocks(1024, 32, bs)["run"] == stock_run


def test_request_blocks_edge_cases():
    """A prompt whose budget cannot hold the sketch frees nothing; a partial last block stays with the output."""
    tokens = cm.Kvcert().sketch_tokens(64, 64)
    short = cm.request_blocks(30, 8, 16, ratio=0.5, sketch_tokens=tokens)  # budget 15 < 17.1 + 1
    assert short["freed"] == 0 and short["run"] == cm.request_blocks(30, 8, 16)["run"] == 3
    odd = cm.request_blocks(1000, 20, 16, ratio=0.5)  # B = 500 -> m = 32; 1000 mod 16 = 8, + 20 -> 2 blocks
    assert (odd["compacted"], odd["run"], odd["freed"]) == (32, 34, 62 - 32)
    assert cm.request_blocks(1000, 20, 16, ratio=0.0)["freed"] == 0


def test_in_flight_is_the_documented_formula():
    """floor((P - 16) / 9) + 1 (docs/serving.md): 34 at P = 320, 70 at 640; the cap binds."""
    assert cm.in_flight(320, 16, 9) == 34 and cm.in_flight(640, 16, 9) == 70
    assert cm.in_flight(640, 16, 9, cap=48) == 48
    assert cm.in_flight(320, 16, 17, prefill_slots=16) == 19  # 16 x 16 + 3 x 17 = 307 <= 320 < 16 x 16 + 4 x 17


def test_more_memory_never_admits_fewer():
    """Requests in flight grow with the GPU's memory and never fall, with and without kvcert."""
    traffic = cm.Traffic("2048", "256", 1.0, 0.5)
    for with_kvcert in (False, True):
        counts = [cm.replica(M8, dataclasses.replace(H100, memory_gib=g), traffic, cm.Kvcert(), cm.Serving(),
                             with_kvcert=with_kvcert)["in_flight_memory"] for g in range(20, 200, 7)]
        assert counts == sorted(counts) and counts[-1] > counts[0]


def test_more_eviction_never_admits_fewer():
    counts = [cm.replica(M8, H100, cm.Traffic("4096", "128", 1.0, r), cm.Kvcert(), cm.Serving(),
                         with_kvcert=True)["in_flight_memory"] for r in (0.0, 0.25, 0.5, 0.75, 0.875)]
    assert counts == sorted(counts) and counts[-1] > 4 * counts[0]


def test_ratio_half_about_doubles_admission_up_to_the_sketch():
    """At ratio 0.5 a long prompt with a short output needs half the blocks: about 2x the requests, less by
    exactly the state charged to the pool (two sketches and log pi, as fractional blocks)."""
    traffic, serving = cm.Traffic("8192", "16", 1.0, 0.5), cm.Serving(batch_cap=10**6)
    runs = {}
    for in_pool in (False, True):
        kv = cm.Kvcert(state_in_pool=in_pool)
        runs[in_pool] = {w: cm.replica(M8, H100, traffic, kv, serving, with_kvcert=w) for w in (False, True)}
    plain, cert = runs[False][False], runs[False][True]
    assert (plain["blocks"]["run"], cert["blocks"]["run"]) == (513, 256)  # ceil(8208 / 16); 255 compacted + 1
    free = cert["in_flight"] / plain["in_flight"]
    assert abs(free - 513 / 256) <= 2 / plain["in_flight"]  # the pool's floor, once in each count
    state = cm.state_bytes(M8, cm.Kvcert(), 255 * 16) / (16 * M8.kv_bytes_per_token)
    assert runs[True][True]["blocks"]["run"] - cert["blocks"]["run"] == pytest.approx(state)
    charged = runs[True][True]["in_flight"] / runs[True][False]["in_flight"]
    assert charged < free and abs(charged - 513 / (256 + state)) <= 2 / plain["in_flight"]


def test_fleet_is_the_ceiling_of_load_over_a_replica():
    assert cm.fleet_size(10, 2.5) == 4 and cm.fleet_size(10, 3, 2) == 8 and cm.fleet_size(10, 10 / 3) == 3
    traffic = cm.Traffic("8192", "1024", 1.0, 0.5, target_rps=37)
    for serving in (cm.Serving(), cm.Serving(gpus_per_replica=2)):
        r = cm.predict(M8, H100, traffic, cm.Kvcert(), serving)
        for name in ("stock", "kvcert"):
            expected = serving.gpus_per_replica * math.ceil(37 / r[name]["requests_per_s"])
            assert r["fleet"][name]["gpus"] == expected
        assert r["fleet"]["kvcert"]["gpus"] < r["fleet"]["stock"]["gpus"]


def test_break_even_decode_ratio_equalizes_requests_per_s():
    traffic = cm.Traffic("2048", "512:1,4096:1", 0.7, 0.5)
    rho = cm.break_even_decode_ratio(M8, H100, traffic, cm.Kvcert(), cm.Serving())
    kv = cm.Kvcert(decode_ratio=rho)
    stock = cm.replica(M8, H100, traffic, kv, cm.Serving(), with_kvcert=False)["requests_per_s"]
    assert cm.replica(M8, H100, traffic, kv, cm.Serving(), with_kvcert=True)["requests_per_s"] == \
        pytest.approx(stock, rel=1e-9)
    assert cm.break_even_decode_ratio(M8, H100, cm.Traffic("2048", "256", 0.0, 0.5), kv, cm.Serving()) is None


def test_decode_step_is_the_roofline():
    """(weights + batch x bytes read) / bandwidth, times 1 + f (rho - 1)."""
    step = cm.decode_step_s(M8, H100, cm.Serving(), batch=100, read_bytes=2e8, certified_fraction=0.5,
                            decode_ratio=1.2)
    assert step["memory_s"] == pytest.approx((M8.weight_bytes + 100 * 2e8) / 3.35e12)
    assert step["step_s"] == pytest.approx(step["memory_s"] * 1.1) and step["bound"] == "memory"


# --------------------------------------------------------------------------------------------- the CPU validation

def test_cpu_admission_within_the_block_rounding(validation):
    """Every validation row's measured requests at once lies in the predicted band; the band is at most
    ceil((s - 1) d / b_run) wide (s prompts in prefill at once, d = the output's blocks), one request here;
    kvcert's rows are exact, and so are the compacted blocks every request recorded."""
    rows = [r for r in validation["admission"] if r.get("scope") == "validation"]
    assert len(rows) == 8 and validation["summary"]["within_band"] == 8
    for r in rows:
        lo, hi = r["band"]
        assert lo <= r["measured"] <= hi and r["predicted"] == lo, r
        d = max(r["blocks_run"] - r["blocks_prefill"], 0)
        assert hi - lo <= math.ceil((r["most_prefills"] - 1) * d / r["blocks_run"]) <= 1, r
        assert r["relative_error"] == pytest.approx((lo - r["measured"]) / r["measured"])
        if r["engine"] != "stock":
            assert r["predicted"] == r["measured"] and r["compacted_predicted"] == r["compacted_measured_mean"]
    assert validation["summary"]["largest_abs_relative_error"] < 0.06  # 18 against 19: one request


def test_cpu_measured_counts_are_cited_where_they_are(validation):
    for r in (r for r in validation["admission"] if "measured" in r):
        line = (ROOT / r["measured_at"]["file"]).read_text().splitlines()[r["measured_at"]["line"] - 1]
        assert line.strip().rstrip(",") == f'"max_concurrent": {r["measured"]}'


def test_poisson_rows_are_upper_bounds(validation):
    """The paper's design pads m to the largest of 90 random counts, which the model does not predict: it
    predicts at least what was measured, and the measured compacted blocks exceed its m."""
    rows = [r for r in validation["admission"] if r.get("scope") == "upper bound"]
    assert len(rows) == 3
    for r in rows:
        assert r["predicted"] >= r["measured"] and r["compacted_measured_mean"] >= r["compacted_predicted"]


def test_admission_ratio_band_holds_the_measured_ratio(validation):
    for r in (r for r in validation["admission_ratios"] if r["scope"] == "validation"):
        assert r["predicted_band"][0] - 1e-12 <= r["measured"] <= r["predicted_band"][1] + 1e-12, r


def test_negative_controls_are_caught(validation):
    """Dropping the block rounding, charging the worker's state to vLLM's pool, or dropping the prefill's
    reserve each predicts counts the runs did not see; forgetting the sketch's 17.1 tokens is not visible at
    these prompt lengths (ceil(495 / bs) = ceil(512 / bs)), which the report says rather than hides."""
    controls = {c["model"]: c for c in validation["controls"]}
    for name in ("no block rounding", "state in the CPU pool", "no prefill reserve"):
        assert controls[name]["caught"], name
        assert any("kvcert" in hit for hit in controls[name]["caught_by"]), name
    assert not controls["sketch forgotten"]["caught"]


def test_roofline_shape_fits_the_cpu_steps_better_than_either_term(validation):
    """Stock's recorded steady decode steps (1k / 2k / 4k prompts, 2-4 requests): one fitted bandwidth for
    weights + KV leaves residuals under half those of weights alone or KV alone."""
    st = validation["step_time"]
    full = st["fit"]["max_abs_residual"]
    assert len(st["fit"]["points"]) == 15
    assert full < 0.5 * st["controls"]["weights only"]["max_abs_residual"]
    assert full < 0.5 * st["controls"]["KV only"]["max_abs_residual"]
    assert st["plugin_over_kept_bytes_roofline"]["median"] > 1  # the plugin costs more than its bytes
    assert "none recorded" in validation["step_time_vs_batch"]


# --------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("make, name", [
    (lambda: dataclasses.replace(H100, memory_gib=-80), "memory_gib"),
    (lambda: dataclasses.replace(H100, bandwidth_tbs=0), "bandwidth_tbs"),
    (lambda: cm.Traffic("2048", "256", 1.0, 1.0), "ratio"),
    (lambda: cm.Traffic("2048", "256", 1.0, -0.1), "ratio"),
    (lambda: cm.Traffic("2048", "256", 1.5, 0.5), "certified_share"),
    (lambda: cm.Traffic("0", "256"), "prompt"),
    (lambda: cm.Traffic("2k", "256"), "prompt"),
    (lambda: cm.Traffic("2048", ""), "output"),
    (lambda: cm.Traffic("2048", "256:-1"), "output weight"),
    (lambda: cm.Traffic("2048", "256", target_rps=-1), "target_rps"),
    (lambda: cm.Serving(utilization=0), "utilization"),
    (lambda: cm.Serving(utilization=1.2), "utilization"),
    (lambda: cm.Serving(block_size=0), "block_size"),
    (lambda: cm.Serving(gpus_per_replica=1.5), "gpus_per_replica"),
    (lambda: cm.Serving(reserve_gib=-1), "reserve_gib"),
    (lambda: cm.Kvcert(decode_ratio=0), "decode_ratio"),
    (lambda: cm.Kvcert(sketch="cluster"), "sketch"),
    (lambda: dataclasses.replace(M8, layers=0), "layers"),
    (lambda: cm.in_flight(10, 16, 9), "pool_blocks"),
    (lambda: cm.fleet_size(0, 1.0), "target_rps"),
])
def test_bad_input_raises_naming_the_argument(make, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        make()


def test_weights_that_do_not_fit_name_tensor_parallel(capsys):
    """70B in bf16 (131.4 GiB) on one H200 (0.9 x 139.8 GiB usable): refused, naming --gpus-per-replica 2;
    two GPUs serve it."""
    traffic = cm.Traffic("2048", "256", 1.0, 0.5, target_rps=10)
    with pytest.raises(cm.WeightsDoNotFit, match=r"^gpus_per_replica: the weights do not fit.*--gpus-per-replica 2"):
        cm.predict(M70, H200, traffic, cm.Kvcert(), cm.Serving())
    r = cm.predict(M70, H200, traffic, cm.Kvcert(), cm.Serving(gpus_per_replica=2))
    assert r["fleet"]["stock"]["gpus"] % 2 == 0
    assert r["stock"]["pool"]["weights_gib"] == pytest.approx(131.4 / 2, abs=0.1)
    assert cm.main(["--model", "llama-3.1-70b", "--gpu", "h200"]) == 2
    assert "--gpus-per-replica 2" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- command line

def test_cli_writes_cited_sources(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cm.main(["--prompt", "2048", "--output", "256", "--target-rps", "10", "--json", str(out)]) == 0
    assert "requests in flight" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["git_commit"] and report["command"].startswith(".venv/bin/python benchmarks/capacity_model.py")
    src = report["sources"]
    assert round(src["decode_ratio"]["json"]["value"], 2) == cm.DECODE_RATIO
    assert report["inputs"]["kvcert"]["decode_ratio"] == cm.DECODE_RATIO
    assert round(src["prefill_ratio"]["json"]["value"], 2) == cm.PREFILL_RATIO
    cites = [c for group in src.values() for c in group.values() if isinstance(c, dict) and "line" in c]
    cites += src["decode_ratio"]["other_lengths"]
    assert len(cites) >= 18
    for c in cites:
        line = (ROOT / c["file"]).read_text().splitlines()[c["line"] - 1]
        assert (c["quote"] if "quote" in c else f'"{c["keys"][-1]}":') in line, c


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("capacity_*.json")),
                         ids=lambda p: p.name)
def test_results_are_what_the_script_gives(path, tmp_path):
    """Each committed result is what its recorded command gives now (inputs, sources aside)."""
    saved = json.loads(path.read_text())
    argv = shlex.split(saved["command"])[2:]
    argv[argv.index("--json") + 1] = str(tmp_path / "again.json")
    assert cm.main(argv) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    for key in ("stock", "kvcert", "ratios", "fleet", "break_even_decode_ratio", "validation", "load_validation"):
        assert json.dumps(again.get(key), sort_keys=True) == json.dumps(saved.get(key), sort_keys=True), key


# --------------------------------------------------------------------------------------------- the load test

def _load_inputs(*, prefill_kvcert=2.0, step_kvcert=0.1):
    """A made-up load test and cost breakdown whose prediction is worked out by hand below: 10 requests of
    64 output tokens, prompts uniform over 1024..1088, blocks of 32, a pool of 100 blocks and 8 clients."""
    load = {"settings": {"requests": 10, "max_tokens": 64, "min_prompt": 1024, "max_prompt": 1088,
                         "block_size": 32, "pool_blocks": 100, "clients": 8, "ratio": 0.5}}
    per_batch = lambda t1: {str(b): {"step_s": t1 * b} for b in (1, 2, 4, 8)}
    breakdown = {"engines": {"stock": {"prefill": {"1024": {"prefill_s": 1.0}, "2048": {"prefill_s": 3.0}},
                                       "per_batch": per_batch(0.1)},
                             "kvcert": {"prefill": {"1024": {"prefill_s": prefill_kvcert},
                                                    "2048": {"prefill_s": 2 * prefill_kvcert + 1.0}},
                                        "per_batch": per_batch(step_kvcert)}}}
    return load, breakdown


def test_interpolate_is_linear_between_and_past_the_points():
    points = {"1024": 1.0, "2048": 3.0, "4096": 5.0}
    assert cm.interpolate(points, 1536) == pytest.approx(2.0)
    assert cm.interpolate(points, 3072) == pytest.approx(4.0)
    assert cm.interpolate(points, 512) == pytest.approx(0.0)  # the first segment extended
    assert cm.interpolate(points, 5120) == pytest.approx(6.0)  # the last one extended
    with pytest.raises(ValueError, match="points"):
        cm.interpolate({"1": 1.0}, 1)


def test_load_prediction_is_the_documented_sum():
    """Stock: prompts 1024..1088 take 34-36 blocks at their last token (mean over the 65 lengths), the pool of
    100 holds the longest prompt in prefill (34 blocks) and floor(66 / mean run) more; the prefill is
    1 s + (n - 1024) / 1024 x 2 s, its mean over the lengths 1.0625 s; the step at b is 0.1 b, so the decode
    costs N o / b x 0.1 b = 64 s whatever b is."""
    load, breakdown = _load_inputs()
    lengths = range(1024, 1089)
    run = sum(math.ceil((n + 64) / 32) for n in lengths) / len(lengths)
    b = 1 + math.floor((100 - math.ceil(1088 / 32)) / run)
    p = cm.load_prediction(load, breakdown, "stock")
    assert p["in_flight"] == b
    assert p["prefill_s_per_request"] == pytest.approx(1.0625)
    assert p["decode_s"] == pytest.approx(64.0)
    assert p["wall_s"] == pytest.approx(10.625 + 64.0)
    assert p["output_tokens_per_s"] == pytest.approx(640 / 74.625)
    half = cm.load_prediction(load, breakdown, "stock", hit_rate=0.5)
    assert half["prefill_s"] == pytest.approx(10.625 / 2)
    assert cm.load_prediction(load, breakdown, "stock", prefill=False)["wall_s"] == pytest.approx(64.0)


def test_load_prediction_parts_move_the_plugin_as_documented():
    """The plugin holds more requests at once (its compacted blocks), pays its own prefill (the event) and
    its own step; taking a part out gives stock's value for that part."""
    load, breakdown = _load_inputs(prefill_kvcert=2.0, step_kvcert=0.05)
    stock = cm.load_prediction(load, breakdown, "stock")
    cert = cm.load_prediction(load, breakdown, "kvcert")
    assert cert["in_flight"] > stock["in_flight"]
    assert cert["prefill_s_per_request"] > stock["prefill_s_per_request"]
    assert cm.load_prediction(load, breakdown, "kvcert", event=False)["prefill_s"] == pytest.approx(stock["prefill_s"])
    assert cm.load_prediction(load, breakdown, "kvcert", admission=False)["in_flight"] == stock["in_flight"]
    # the step is linear in b here, so the decode time is b-free: 10 x 64 x 0.05 s
    assert cert["decode_s"] == pytest.approx(32.0)


def test_load_validation_reads_the_runs_it_cites():
    """The validation's measured numbers are the load test's and the replay's, and the parts move the ratio the
    way their costs say: taking out the event or the prefill raises it, taking out the admission lowers it."""
    v = cm.validate_load()
    load = json.loads((ROOT / cm.LOAD_RUN).read_text())
    replay = json.loads((ROOT / cm.REPLAY_RUN).read_text())
    assert v["ratio"]["measured"] == load["summary"]["throughput_ratio"]
    assert v["ratio"]["replay"] == replay["ratios_kvcert_over_stock"]["output_tokens_per_s"]
    for name in ("stock", "kvcert"):
        assert v["engines"][name]["measured_output_tokens_per_s"] == load["servers"][name]["output_tokens_per_s"]
    parts = v["parts"]
    assert parts["decode only (no prefill in either)"] > parts["without the eviction event (the plugin prefills as stock)"] \
        > parts["as measured"] > parts["without the larger admission (stock's b)"]
