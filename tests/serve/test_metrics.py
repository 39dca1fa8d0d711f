"""/metrics: vLLM's series under `kvserve:` (or `vllm:`), moving exactly as the engine works."""

from __future__ import annotations

import time

import httpx

from tests.serve.conftest import ENGINE, metric, scrape, start_server, stop_server

P = "kvserve:"


def complete(server, prompt: str, **extra) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 5, "ignore_eos": True, **extra}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_counters_and_histograms_follow_each_request(server):
    prompt = "Counting tokens through the metrics endpoint, one block at a time. " * 2
    before = scrape(server)
    first = complete(server, prompt)
    again = complete(server, prompt)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, P + name, **labels) - metric(before, P + name, **labels)

    prompt_tokens = first["usage"]["prompt_tokens"] + again["usage"]["prompt_tokens"]
    assert delta("prompt_tokens_total") == prompt_tokens
    assert delta("generation_tokens_total") == 10
    assert delta("request_success_total", finished_reason="length") == 2
    assert delta("prefix_cache_queries_total") == prompt_tokens
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and delta("prefix_cache_hits_total") == cached
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert delta(f"{name}_count") == 2, name
    assert delta("inter_token_latency_seconds_count") == 8  # 4 gaps after each first token
    assert delta("iteration_tokens_total_count") >= 5
    assert delta("iteration_tokens_total_sum") >= prompt_tokens - cached
    assert metric(after, P + "num_requests_running") == 0
    assert metric(after, P + "num_requests_waiting") == 0
    assert metric(after, P + "kv_cache_usage_perc") == 0  # cached free blocks are not used
    assert delta("external_prefix_cache_queries_total") == 0  # no tiers configured
    info = [k for k in after if k.startswith(P + "cache_config_info")]
    assert len(info) == 1
    assert f"block_size={ENGINE['block_size']}" in info[0]
    assert f"num_gpu_blocks={ENGINE['num_kv_blocks'] - 1}" in info[0]  # block 0 is the null block
    assert "enable_prefix_caching=True" in info[0] and "prefix_caching_hash_algo=" in info[0]
    assert f"model_name={server.model}" in info[0] or "model_name" not in info[0]


def test_running_requests_show_in_the_gauges(server):
    body = {"model": server.model, "prompt": "keep going", "max_tokens": 400, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        next(lines)
        busy = scrape(server)
        assert metric(busy, P + "num_requests_running") == 1
        assert 0 < metric(busy, P + "kv_cache_usage_perc") < 1
        for _ in lines:
            pass
    idle = scrape(server)
    assert metric(idle, P + "num_requests_running") == 0
    assert metric(idle, P + "kv_cache_usage_perc") == 0


def test_vllm_prefix_and_a_disconnect_going_idle_within_a_second(demo):
    srv = start_server(demo, "--metrics-prefix", "vllm", "--api-key", "k")
    body = {"model": srv.model, "prompt": "go on", "max_tokens": 2000, "ignore_eos": True}
    headers = {"Authorization": "Bearer k"}
    try:
        names = scrape(srv, "vllm")  # /metrics stays open without the key
        assert not scrape(srv, "kvserve")
        for name in ("num_requests_running", "kv_cache_usage_perc", "prefix_cache_hits_total"):
            assert any(k.startswith(f"vllm:{name}{{") for k in names), name
        with httpx.stream(
            "POST",
            f"{srv.url}/v1/completions",
            json={**body, "stream": True},
            headers=headers,
            timeout=60,
        ) as resp:
            lines = resp.iter_lines()  # dropping the iterator would hang up at once
            next(lines)
            assert metric(scrape(srv, "vllm"), "vllm:num_requests_running") == 1
            del lines
        gone = time.monotonic()
        while time.monotonic() - gone < 1.0:
            now = scrape(srv, "vllm")
            if metric(now, "vllm:num_requests_running") == 0:
                break
            time.sleep(0.05)
        assert metric(now, "vllm:num_requests_running") == 0
        assert metric(now, "vllm:kv_cache_usage_perc") == 0
        assert metric(now, "vllm:request_success_total", finished_reason="abort") == 1
    finally:
        stop_server(srv)
