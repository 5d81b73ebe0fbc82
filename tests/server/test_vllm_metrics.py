"""/metrics under vLLM's names (the fake engine): the same values as rtp's series, a model_name label."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_api import MODEL, make_app


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rtp.testing import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_vllm_names_mirror_rtp_series(tokenizer):
    app, _, _ = make_app(tokenizer)
    with TestClient(app) as client:
        for max_tokens in (3, 5):
            r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": max_tokens})
            assert r.status_code == 200
        text = client.get("/metrics").text
    got = samples(text)
    labels = (("engine", "0"), ("model_name", MODEL))

    def v(name: str, extra: tuple = ()) -> float:
        return got[(name, tuple(sorted(labels + extra)))]

    prompt_tokens = len(tokenizer.encode("Once upon a time", add_special_tokens=False))
    assert v("vllm:prompt_tokens_total") == got[("rtp_prompt_tokens_total", ())] == 2 * prompt_tokens
    assert v("vllm:generation_tokens_total") == got[("rtp_generation_tokens_total", ())] == 8
    assert v("vllm:request_success_total", (("finished_reason", "length"),)) == 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_time_per_output_token_seconds"):
        assert v(f"vllm:{name}_count") == got[(f"rtp_{name}_count", ())] == 2, name
        assert v(f"vllm:{name}_sum") == pytest.approx(got[(f"rtp_{name}_sum", ())]), name
    # 2 + 4 inter-token gaps; vLLM's older name carries the same histogram.
    assert v("vllm:inter_token_latency_seconds_count") == v("vllm:time_per_output_token_seconds_count") == 6
    # Gauges from the fake's stats: nothing running after the requests, 10 prefix tokens looked up, 4 hit.
    assert v("vllm:num_requests_running") == 0 and v("vllm:num_requests_waiting") == 0
    assert v("vllm:kv_cache_usage_perc") == 0.0
    assert v("vllm:prefix_cache_queries_total") == 10 and v("vllm:prefix_cache_hits_total") == 4
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_speculative_decoding_counters_under_both_names():
    from rtp.server.metrics import ServerMetrics

    stats = {"spec_num_drafts": 5, "spec_num_draft_tokens": 20, "spec_num_accepted_tokens": 9,
             "spec_accepted_pos_0": 4, "spec_accepted_pos_1": 3, "spec_accepted_pos_2": 2, "spec_accepted_pos_3": 0}
    got = samples(ServerMetrics(lambda: stats, model_name="m").render()[0].decode())
    labels = (("engine", "0"), ("model_name", "m"))
    for rtp_name, vllm_name, value in [("drafts", "num_drafts", 5), ("draft_tokens", "num_draft_tokens", 20),
                                       ("accepted_tokens", "num_accepted_tokens", 9)]:
        assert got[(f"rtp_spec_decode_{rtp_name}_total", ())] == value
        assert got[(f"vllm:spec_decode_{vllm_name}_total", labels)] == value
    for pos, value in enumerate([4, 3, 2, 0]):
        assert got[("rtp_spec_decode_accepted_tokens_per_pos_total", (("position", str(pos)),))] == value
        key = tuple(sorted(labels + (("position", str(pos)),)))
        assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", key)] == value
    off = samples(ServerMetrics(lambda: {}, model_name="m").render()[0].decode())
    assert not any("spec_decode" in name for name, _ in off)
