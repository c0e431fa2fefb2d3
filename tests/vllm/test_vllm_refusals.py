"""Configurations the plugin cannot serve fail at start-up, before any engine starts, naming the option."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from vllm_support import model_path, vllm_env

for _k, _v in vllm_env().items():  # offline, caches in the work tree (this process builds engine configs)
    if _k.startswith(("VLLM_", "HF_", "TRANSFORMERS_")):
        os.environ.setdefault(_k, _v)

from kvcert.vllm import KVCertConfig, certified_llm, engine_kwargs  # noqa: E402


@pytest.mark.parametrize("kwargs, option", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
     "speculative_config"),
    ({"data_parallel_size": 2}, "data_parallel_size=2 in one vllm.LLM"),
    # the default model has 3 KV heads (3 ranks: one each); the random scorer's stream is per rank
    ({"tensor_parallel_size": 3, "scorer": "random"}, "tensor_parallel_size=3 with scorer='random'"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}}, "kv_transfer_config"),
    ({"dtype": "float16"}, "dtype"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"scheduler_cls": "vllm.v1.core.sched.async_scheduler.AsyncScheduler"}, "scheduler_cls"),
    ({"worker_cls": "vllm.v1.worker.cpu_worker.CPUWorker"}, "worker_cls"),
])
def test_refused_engine_options_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=f"kvcert.vllm cannot serve {option}"):
        certified_llm(model_path(), compression_ratio=0.5, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"compression_ratio": 1.0}, "compression_ratio"),
    ({"compression_ratio": -0.1}, "compression_ratio"),
    ({"seed": -1}, "seed"),
    ({"kvcert": {"granularity": "block", "recent_blocks": 0}}, "recent_blocks"),
    ({"kvcert": {"recent_blocks": 1}}, "recent_blocks: option\\(s\\) of the block design"),
    ({"kvcert": {"granularity": "block", "sinks": 2}}, "sinks: option\\(s\\) of the token design"),
    ({"granularity": "page"}, "granularity must be one of"),
    ({"kvcert": {"floor": 0.0}}, "floor"),
    ({"kvcert": {"delta": 1.5}}, "delta"),
    ({"kvcert": {"kind": "wald"}}, "kind"),
    ({"kvcert": {"granularity": "block", "window": 3}}, "window"),
    ({"kvcert": {"window": -1}}, "window"),
    ({"kvcert": {"kind": "chebyshev_ucb"}}, "kind"),
    ({"kvcert": {"scorer": "nope"}}, "scorer"),
    ({"scorer": "nope"}, "scorer"),
    ({"kvcert": {"granularity": "block", "reduce": "min"}}, "reduce"),
    ({"kvcert": {"sampling": "bernoulli"}}, "sampling must be one of"),
    ({"kvcert": {"granularity": "block", "sampling": "systematic"}}, "sampling: option\\(s\\) of the token design"),
])
def test_bad_plugin_settings_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        certified_llm(model_path(), **kwargs)


def test_unsupported_model_is_refused(tmp_path):
    # the default model's folder with a sliding-window Mistral config: refused on the resolved config
    src = model_path()
    folder = tmp_path / "swa-model"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="kvcert.vllm cannot serve model .*sliding_window=64"):
        certified_llm(str(folder), compression_ratio=0.5, max_model_len=256, block_size=32)


def test_engine_kwargs_route_and_config_roundtrip():
    kw = engine_kwargs(0.25, 7, kvcert={"top_blocks": 1}, granularity="block", max_model_len=256)
    assert kw["scheduler_cls"] == "kvcert.vllm.scheduler.CertifiedScheduler"
    assert kw["worker_cls"] == "kvcert.vllm.worker.CertifiedCPUWorker"
    assert "enable_prefix_caching" not in kw and kw["async_scheduling"] is False  # vLLM's default: the cache on
    assert kw["max_model_len"] == 256
    cfg = KVCertConfig.from_dict(kw["additional_config"]["kvcert"])
    assert cfg == KVCertConfig(compression_ratio=0.25, seed=7, granularity="block", top_blocks=1)
    # budget: None when the certainty set fills it (short prompts are not evicted)
    assert cfg.budget(3) is None and cfg.budget(10) == pytest.approx(7.5)
    assert KVCertConfig(compression_ratio=0.0, granularity="block").budget(100) is None
    # the token design: the press's, sampled whenever its budget is below the prompt
    token = KVCertConfig.from_dict(engine_kwargs(0.25, 7)["additional_config"]["kvcert"])
    assert token.granularity == "token" and token.evicts(3, 32) and not KVCertConfig(compression_ratio=0.0).evicts(100, 32)
    import kvcert

    # the PoissonPress defaults: the recommended design (the tilted sketch, tilted_hull)
    assert token.design == kvcert.PoissonPress(compression_ratio=0.25, seed=7).design
    assert (token.design.kind, token.design.sketch.tilt) == ("tilted_hull", True)


def test_kinds_reductions_and_scorers_are_read_from_the_registries():
    from kvcert import fast as F

    for name in F.KINDS:  # the served kinds are the registry's flags, no list of the plugin's own
        if F.CERTIFICATE_KINDS[name].served:
            assert KVCertConfig(kind=name).design.kind == name
        elif F.CERTIFICATE_KINDS[name].sketch:  # a sketched design's radius: served with its sketch (the default)
            assert KVCertConfig(kind=name).design.kind == name and KVCertConfig(kind=name).design.sketch is not None
            with pytest.raises(ValueError, match="kind must be one of"):
                KVCertConfig(kind=name, sketch=None)
        else:
            with pytest.raises(ValueError, match="kind must be one of"):
                KVCertConfig(kind=name)
    for name in F.REDUCTIONS:
        assert KVCertConfig(granularity="block", reduce=name).design.reduce == name
    for name in F.SCORERS:  # any registered scorer, by configuration
        kw = engine_kwargs(0.5, 0, scorer=name)
        cfg = KVCertConfig.from_dict(kw["additional_config"]["kvcert"])
        assert cfg.scorer == cfg.design.scorer == name and cfg.to_dict()["scorer"] == name
        same = engine_kwargs(0.5, 0, kvcert={"scorer": name})["additional_config"]["kvcert"]
        assert KVCertConfig.from_dict(same) == cfg
    assert KVCertConfig(granularity="block").design.kernel_size == 1  # the block design: SnapKV without pooling
    assert KVCertConfig().scorer == "snapkv" and KVCertConfig().design.kernel_size == 7  # the press's SnapKV
    with pytest.raises(ValueError, match="scorer: given twice"):
        engine_kwargs(0.5, 0, scorer="tova", kvcert={"scorer": "knorm"})
    design = KVCertConfig(compression_ratio=0.25, granularity="block", top_blocks=1).design
    assert design.block_size is None
    assert design.budget(10) == KVCertConfig(compression_ratio=0.25, granularity="block", top_blocks=1).budget(10) == 7.5
