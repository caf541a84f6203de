"""What an HTTP pair reads of its servers beyond completions: D's size from ``/metrics``, D's placement support."""

from __future__ import annotations

from agentkv._engines._http_capabilities import DecodeCapacity, parse_capacity

# vLLM 0.32's exposition of its cache configuration (one gauge per engine; labels abridged to the ones read
# and a few neighbours, in the order vLLM writes them)
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_cpu_blocks="None",num_gpu_blocks="182",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="1",num_cpu_blocks="None",num_gpu_blocks="150",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_d_s_size_is_its_smallest_engine_s_blocks() -> None:
    assert parse_capacity(METRICS) == DecodeCapacity(150, 128)  # a request runs on one engine: the smaller


def test_a_server_without_its_cache_configuration_says_nothing() -> None:
    assert parse_capacity("") is None
    before_profiling = [
        line.replace('num_gpu_blocks="182"', 'num_gpu_blocks="None"')
        for line in METRICS.splitlines()
        if 'engine="1"' not in line
    ]
    assert parse_capacity("\n".join(before_profiling) + "\n") is None
