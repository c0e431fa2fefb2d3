"""Runs one vLLM engine in a process of its own and writes what the tests compare (JSON).

    python tests/vllm/vllm_driver.py SPEC.json OUT.json

Not a test module: tests/vllm/vllm_support.py launches it, one engine per
process, so every engine is torn down completely and the stock engine can run
without the plugin (``VLLM_PLUGINS=""`` set by the launcher). SPEC keys:
``plugin`` (bool), ``model``, ``compression_ratio``, ``seed``, ``kvcert``
(dict), ``scorer`` (optional, ``certified_llm``'s keyword), ``llm_kwargs`` (dict),
``prompts`` (token-id lists), ``runs``
(list of {"order": [prompt indices], "max_tokens": int}, generated one
``generate`` call each, greedy; optional ``"extra_args"``: a list parallel to
``order`` of ``SamplingParams.extra_args`` dicts or None, e.g.
``{"kvcert_compression_ratio": 0.5}``; a prompt index at most once per run).
Each output records ``token_ids`` and ``finish_reason``, and with the plugin
``certificates`` and ``report``.
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    if spec["plugin"]:
        from kvcert.vllm import certified_llm

        llm = certified_llm(spec["model"], compression_ratio=spec["compression_ratio"], seed=spec["seed"],
                            kvcert=spec.get("kvcert") or None, scorer=spec.get("scorer"), **spec["llm_kwargs"])
    else:
        llm = LLM(model=spec["model"], **spec["llm_kwargs"])
    result = {"start_s": time.perf_counter() - t0, "runs": []}
    prompts = spec["prompts"]
    for run in spec["runs"]:
        order = run["order"]
        extra = run.get("extra_args") or [None] * len(order)
        sp = [SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True, extra_args=e)
              for e in extra]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], sp, use_tqdm=False)
        gen_s = time.perf_counter() - t
        per = {}
        for i, o in zip(order, outs):
            item = {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
            if spec["plugin"]:
                from kvcert.vllm import certificate_report, certificates

                c = certificates(o)
                item["certificates"] = None if c is None else c.tolist()
                item["report"] = certificate_report(o)
            per[str(i)] = item
        result["runs"].append({"outputs": per, "gen_s": gen_s})
    if spec["plugin"]:
        from kvcert.vllm import blocks_freed, stats

        result["stats"] = stats(llm)
        result["blocks_freed"] = blocks_freed(llm)
    with open(out_path, "w") as f:
        json.dump(result, f)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort, the process exits anyway
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
