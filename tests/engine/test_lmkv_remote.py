"""Two engine processes share KV through a remote tier (a real redis-server), and a dead or
corrupting store costs a recompute, never a wrong token or an error."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import redis

from ..mooncake_store import MooncakeStore
from ..redis_server import RedisServer, start_cluster
from .lmkv_workload import CHUNK, GREEDY, lmkv_llm, metric, prompts
from .test_lmkv_e2e import _fill_disk, _full_chunks, reference  # noqa: F401 - fixture


def _fill_remote(model_dir, url):
    return _fill_disk(model_dir, "-", 1, url)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


def test_second_process_reuses_kv_through_redis(tiny_model_dir, reference, redis_server):  # noqa: F811
    written = _fill_remote(tiny_model_dir, redis_server.url)
    assert written[0] == reference()
    with lmkv_llm(tiny_model_dir, remote_url=redis_server.url) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert [o.num_external_tokens for o in outs] == [_full_chunks(p) for p in prompts()]
        assert metric(llm, "lmkv_tier_hits_total", tier="remote") > 0


def test_second_process_reuses_kv_through_redis_cluster(tiny_model_dir, reference, tmp_path):  # noqa: F811
    servers = start_cluster(tmp_path / "cluster")
    try:
        url = f"redis-cluster://127.0.0.1:{servers[0].port}"
        _fill_remote(tiny_model_dir, url)
        with lmkv_llm(tiny_model_dir, remote_url=url) as llm:
            outs = llm.generate(prompts(), GREEDY)
            assert [o.output_token_ids for o in outs] == reference()
            assert all(o.num_external_tokens == _full_chunks(p) for o, p in zip(outs, prompts(), strict=True))
    finally:
        for s in servers:
            s.kill()


def _reads_resume(llm, batch, deadline: float = 15.0) -> None:
    """``batch`` (prompts whose chunks the store holds) loaded from the remote tier once
    more: reads resume after the store came back (asked again with the hot cache emptied,
    each time the breaker may still hold reads off), with the tokens of a run without lmkv."""
    from lmkv_engines.minimal.llm import LLM

    want = [o.output_token_ids for o in LLM(llm.engine.config.model, kv_cache_memory=64 << 20)
            .generate(batch, GREEDY)]
    before = metric(llm, "lmkv_tier_hits_total", tier="remote")
    end = time.monotonic() + deadline
    while True:
        llm.engine.kv_connector.cache.storage.hot.clear()
        outs = llm.generate(batch, GREEDY)
        assert [o.output_token_ids for o in outs] == want
        if metric(llm, "lmkv_tier_hits_total", tier="remote") > before:
            assert any(o.num_external_tokens for o in outs)
            return
        assert time.monotonic() < end, "reads from the store never resumed"
        time.sleep(0.5)


def test_killed_store_costs_recompute_and_reconnects(tiny_model_dir, reference, redis_server):  # noqa: F811
    with lmkv_llm(tiny_model_dir, remote_url=redis_server.url, remote_timeout=0.5, cpu_gb=1e-4) as llm:
        llm.generate(prompts(), GREEDY)
        llm.engine.kv_connector.cache.storage.io.drain()
        redis_server.kill()  # kill -9
        start = time.monotonic()
        outs = llm.generate(prompts(), GREEDY)  # the hot cache holds 3 of the 38 chunks
        assert [o.output_token_ids for o in outs] == reference()
        assert time.monotonic() - start < 30  # at most one timeout per breaker interval
        assert sum(metric(llm, "lmkv_errors_total", tier="remote", kind=k)
                   for k in ("contains", "get", "put")) > 0
        RedisServer(redis_server.workdir, port=redis_server.port).start()
        try:
            time.sleep(2.5)  # past the breaker's interval
            llm.generate(prompts(seed=3)[:2], GREEDY)
            llm.engine.kv_connector.cache.storage.io.drain()
            assert redis.Redis(port=redis_server.port).dbsize() > 0  # writing again
            _reads_resume(llm, prompts(seed=3)[:2])  # and reading
        finally:
            subprocess.run(["redis-cli", "-p", str(redis_server.port), "shutdown", "nosave"],
                           capture_output=True)


def test_flipped_bytes_in_the_store_are_detected(tiny_model_dir, reference, redis_server):  # noqa: F811
    _fill_remote(tiny_model_dir, redis_server.url)
    client = redis.Redis(port=redis_server.port)
    for key in client.keys("*"):
        value = bytearray(client.get(key))
        value[len(value) // 3] ^= 0x10
        client.set(key, bytes(value))
    with lmkv_llm(tiny_model_dir, remote_url=redis_server.url) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert all(o.num_external_tokens == 0 for o in outs)
        assert metric(llm, "lmkv_errors_total", tier="remote", kind="corrupt") > 0


@pytest.mark.skipif(shutil.which("mooncake_master") is None, reason="mooncake is not installed")
def test_second_process_reuses_kv_through_mooncake(tiny_model_dir, reference, tmp_path):  # noqa: F811
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    store = MooncakeStore(tmp_path / "mooncake").start()
    try:
        _fill_remote(tiny_model_dir, store.url)
        with lmkv_llm(tiny_model_dir, remote_url=store.url) as llm:
            outs = llm.generate(prompts(), GREEDY)
            assert [o.output_token_ids for o in outs] == reference()
            assert all(o.num_external_tokens == _full_chunks(p) for o, p in zip(outs, prompts(), strict=True))
            assert metric(llm, "lmkv_tier_hits_total", tier="remote") > 0
    finally:
        store.kill()


@pytest.mark.skipif(shutil.which("mooncake_master") is None, reason="mooncake is not installed")
def test_a_hung_mooncake_master_costs_a_recompute_not_a_stalled_engine(tiny_model_dir, reference,  # noqa: F811
                                                                       tmp_path):
    """A Mooncake master that stops answering (SIGSTOP: a hung host) makes its client wait
    30 s per call, and a new client's setup() holds the GIL for up to 20 x 30 s (the whole
    engine stood still for 10 minutes here). lmkv keeps its client, which answers again once
    the master does, and probes the metadata server before making one: prompts are
    recomputed (the same tokens) within a load's FETCH_TIMEOUT, with a master hung before lmkv
    starts (its probe at start meets it) and one that hangs later, and loads come back with
    the master."""
    import signal

    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    store = MooncakeStore(tmp_path / "mooncake").start()
    master = store.procs[0]

    def timed_run(llm):
        start = time.monotonic()
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        return outs, time.monotonic() - start

    try:
        _fill_remote(tiny_model_dir, store.url)
        for connected_first in (False, True):
            if not connected_first:  # hung before lmkv starts: its probe at start finds it
                os.kill(master.pid, signal.SIGSTOP)
            with lmkv_llm(tiny_model_dir, remote_url=store.url, remote_timeout=0.5,
                          cpu_gb=1e-4) as llm:  # the hot cache holds 3 of the 38 chunks
                if connected_first:
                    outs, _ = timed_run(llm)
                    assert any(o.num_external_tokens > 0 for o in outs)
                os.kill(master.pid, signal.SIGSTOP)
                try:
                    outs, took = timed_run(llm)
                finally:
                    os.kill(master.pid, signal.SIGCONT)
                assert took < 25, f"{took:.0f} s"
                assert sum(metric(llm, "lmkv_errors_total", tier="remote", kind=k)
                           for k in ("contains", "get", "probe")) + metric(
                               llm, "lmkv_errors_total", tier="io", kind="timeout") >= 1
                if connected_first:  # the same client, once the master answers again
                    deadline = time.monotonic() + 60
                    while not any(o.num_external_tokens > 0 for o in timed_run(llm)[0]):
                        assert time.monotonic() < deadline, "loads did not come back"
                        time.sleep(1)
    finally:
        store.kill()


def test_store_down_at_start_is_picked_up_later(tiny_model_dir, reference, tmp_path):  # noqa: F811
    server = RedisServer(tmp_path / "redis")  # not started yet
    with lmkv_llm(tiny_model_dir, remote_url=server.url, remote_timeout=0.5) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        server.start()
        try:
            time.sleep(2.5)  # past the breaker's interval
            llm.generate(prompts(seed=4)[:2], GREEDY)
            llm.engine.kv_connector.cache.storage.io.drain()
            assert redis.Redis(port=server.port).dbsize() > 0
            _reads_resume(llm, prompts(seed=4)[:2])
        finally:
            server.kill()


def test_prefill_decode_disaggregation_through_a_shared_store(tiny_model_dir, redis_server):
    """A producer engine computes the prompts' KV (prefill only); a consumer engine in
    another process loads it and decodes: the same tokens as one engine doing both."""
    from lmkv_engines.minimal.llm import LLM
    from lmkv_engines.minimal.sampling_params import SamplingParams

    want = [o.output_token_ids for o in LLM(str(tiny_model_dir), kv_cache_memory=64 << 20)
            .generate(prompts(), GREEDY)]
    with lmkv_llm(tiny_model_dir, remote_url=redis_server.url, kv_role="producer") as producer:
        producer.generate(prompts(), SamplingParams(max_tokens=1, temperature=0))
        assert metric(producer, "lmkv_loaded_tokens_total") == 0
    consumed = _fill_disk(tiny_model_dir, "-", 1, redis_server.url, role="consumer", full=True)
    assert consumed[0]["tokens"] == want
    assert consumed[0]["external"] == [_full_chunks(p) for p in prompts()]
    stored = redis.Redis(port=redis_server.port).dbsize()
    assert stored == sum(_full_chunks(p) // 32 for p in prompts())  # the consumer saved nothing


def test_second_process_reuses_kv_through_lmkv_server(tiny_model_dir, reference, spawn_server):  # noqa: F811
    server = spawn_server("--max-memory", "64MiB")
    _fill_remote(tiny_model_dir, server.url)
    # a hot cache of ~9 chunks: one request fits, the 38 chunks of all six do not
    with lmkv_llm(tiny_model_dir, remote_url=server.url, cpu_gb=3e-4, remote_timeout=1.0) as llm:
        outs = [llm.generate([p], GREEDY)[0] for p in prompts()]  # one at a time: each fits
        assert [o.output_token_ids for o in outs] == reference()
        assert all(o.num_external_tokens == _full_chunks(p) for o, p in zip(outs, prompts(), strict=True))
        assert metric(llm, "lmkv_tier_hits_total", tier="remote") > 0
        server.kill()  # kill -9 mid-run: correct tokens by recompute, no error
        outs = llm.generate(prompts(), GREEDY)
        assert [o.output_token_ids for o in outs] == reference()
        assert sum(metric(llm, "lmkv_errors_total", tier="remote", kind=k)
                   for k in ("contains", "get", "put")) > 0


@pytest.mark.interop
def test_local_cpu_false_serves_every_hit_from_lmcache_server(tiny_model_dir, reference, lmcache_server):  # noqa: F811
    """LMCache's meaning of local_cpu: false, against LMCache's own server: no chunk stays in
    CPU memory; the remote tier serves the hits, in this process and in a new one."""
    with lmkv_llm(tiny_model_dir, remote_url=lmcache_server, local_cpu=False) as llm:
        first = llm.generate(prompts(), GREEDY)
        lmkv = llm.engine.kv_connector.cache
        lmkv.storage.io.drain()
        assert len(lmkv.storage.hot) == 0
        again = llm.generate(prompts(), GREEDY)
        assert len(lmkv.storage.hot) == 0
        lmkv.pool.check_integrity()
        assert lmkv.pool.num_free == lmkv.pool.num_slots  # staging only: every slot back
        assert metric(llm, "lmkv_tier_hits_total", tier="hot") == 0
        assert metric(llm, "lmkv_tier_hits_total", tier="remote") == sum(
            _full_chunks(p) for p in prompts()) // CHUNK
    assert [o.output_token_ids for o in first] == reference()
    assert [o.output_token_ids for o in again] == reference()
    assert [o.num_external_tokens for o in again] == [_full_chunks(p) for p in prompts()]
