"""Second-instance TTFT for a 4K-token prompt via each remote store vs recompute.

For each remote backend, a real store on loopback (redis-server; an lmkv_server process;
a Mooncake master + storage process):
- process A, the bundled engine with lmkv (remote_url at the store, a small hot cache, no
  disk), runs the prompt once; closing it waits for the background remote writes.
- a fresh process B with the same config times TTFT (max_tokens=1, greedy) of the prompt,
  its KV loaded from the store (B's hot cache is emptied before each run, so every run
  reads the store, as a fresh instance would), and TTFT of recompute: the same prompt in an
  engine without lmkv in the same process, its prefix cache emptied first. The greedy token
  of every remote run must equal the recompute's.
- the floor: the loaded frames' bytes / the store's get bandwidth (one batched get of the
  same keys through lmkv's backend client, no decode or copy into the engine) + computing
  the uncached tail with the loaded tokens already in place (the engine's prefix cache).
  Remote, recompute, get and tail runs are interleaved; each reported time is a median.
Prints two lines per backend, each ending in its ratio.

With ``--link RTT_MS:MB_PER_S,...`` process B also reaches the store through a relay that
delays each direction by half the round trip and caps its bandwidth (slow_link.py), once
per link (redis and lm; Mooncake's client opens connections of its own to ports the
master hands out, which a relay in front of one port does not cover): what a store in
another rack or region buys, next to recomputing. Process A writes over loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import MODEL_HELP, bench_model, random_prompt  # noqa: E402
from lmkv_ttft import FIRST_TOKEN, lmkv_llm, tail_ttft, ttft  # noqa: E402
from slow_link import SlowLink  # noqa: E402

from lmkv_engines.minimal.llm import LLM  # noqa: E402
from lmkv_engines.minimal.outputs import RequestOutput  # noqa: E402
from tests.engine.lmkv_workload import metric  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("redis", "lm", "mooncake")
CPU_GB = 0.5  # each engine's hot cache: a 4096-token prompt's KV is 64 MiB here
REMOTE_TIMEOUT = 10.0  # generous: the store shares a loaded machine with the engines


def start_store(name: str, workdir: Path) -> tuple[str, Callable[[], None]]:
    """A store of kind ``name`` on loopback: its URL and how to stop it. RuntimeError when
    its program is not installed."""
    workdir.mkdir(parents=True, exist_ok=True)
    if name == "redis":
        from tests.redis_server import RedisServer

        server = RedisServer(workdir).start()
        return server.url, server.kill
    if name == "lm":
        from lmkv_server.launcher import ServerProcess, child_env

        lm = ServerProcess("--max-memory", "512MiB", env=child_env(REPO),
                           log_path=workdir / "server.log").start()
        return lm.url, lm.stop
    if name == "mooncake":
        from tests.mooncake_store import MooncakeStore

        # inherited by the engine processes; the venv's Mooncake programs come first
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        store = MooncakeStore(workdir, segment="1 GB").start()
        return store.url, store.kill
    raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")


def remote_llm(args) -> LLM:
    return lmkv_llm(args.model_dir, args.chunk, {}, cpu_gb=CPU_GB, remote_url=args.url,
                    remote_timeout=REMOTE_TIMEOUT)


def first_instance(args) -> dict:
    """Process A: compute the prompt's KV and store it; close() drains the remote writes."""
    llm = remote_llm(args)
    llm.generate([random_prompt(args.prompt_tokens, 32000, seed=0)], FIRST_TOKEN)
    llm.close()
    return {"written": metric(llm, "lmkv_tier_seconds_count", tier="remote", op="put"),
            "errors": sum(metric(llm, "lmkv_errors_total", tier="remote", kind=k)
                          for k in ("put", "contains")),
            "dropped": metric(llm, "lmkv_dropped_total", what="save_remote")}


def remote_run(llm: LLM, prompt: list[int]) -> tuple[float, RequestOutput]:
    """TTFT with nothing in the hot cache: every stored chunk comes from the store."""
    llm.engine.kv_connector.cache.storage.hot.clear()
    start = time.perf_counter()
    out = llm.generate([prompt], FIRST_TOKEN)[0]
    return time.perf_counter() - start, out


def recompute_run(plain: LLM, prompt: list[int]) -> float:
    plain.engine.block_manager.reset_prefix_cache()
    return ttft(plain, prompt)


def second_instance(args) -> dict:
    """Process B: TTFT via the store and by recompute, interleaved; the floor's parts."""
    n = args.prompt_tokens
    prompt = random_prompt(n, 32000, seed=0)
    llm = remote_llm(args)
    plain = LLM(str(args.model_dir), kv_cache_memory=1 << 30)  # no lmkv; prefix cache on
    lm = llm.engine.kv_connector.cache
    # warm-up on a prompt the store does not have (it opens the connection), then wait
    # for its chunks' background writes so they do not overlap the timed runs
    warm_up = random_prompt(n, 32000, seed=1)
    recompute_run(plain, warm_up)
    ttft(llm, warm_up)
    lm.storage.io.drain()
    loaded_before = metric(llm, "lmkv_loaded_tokens_total")
    backend = lm.storage.tiers[0].backend
    # all four interleaved, so that a shared machine's load spikes hit each alike
    remote, recompute, gets, tails, outs = [], [], [], [], []
    for _ in range(args.repeats):
        t, out = remote_run(llm, prompt)
        remote.append(t)
        outs.append(out)
        recompute.append(recompute_run(plain, prompt))
        # the floor's parts: one batched get of the loaded chunks' frames; the tail's compute
        keys = lm.keys(prompt)[: out.num_external_tokens // args.chunk]
        start = time.perf_counter()
        frames = backend.get(keys)
        gets.append(time.perf_counter() - start)
        assert all(f is not None for f in frames)
        tails.append(tail_ttft(plain, prompt, out.num_external_tokens))
    want = plain.generate([prompt], FIRST_TOKEN)[0].output_token_ids
    assert all(o.output_token_ids == want for o in outs), "remote KV changed the greedy token"
    hit = outs[0].num_external_tokens
    assert all(o.num_external_tokens == hit for o in outs)
    loaded = (metric(llm, "lmkv_loaded_tokens_total") - loaded_before) / args.repeats
    assert loaded == hit, f"engine reports {hit} external tokens, lmkv loaded {loaded}"
    llm.close()
    return {"remote": statistics.median(remote), "recompute": statistics.median(recompute),
            "hit": hit, "bytes": sum(len(f) for f in frames), "get": statistics.median(gets),
            "tail": statistics.median(tails)}


def child(args, role: str, url: str, model_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--url", url, "--model-dir", str(model_dir),
           "--prompt-tokens", str(args.prompt_tokens), "--chunk", str(args.chunk),
           "--repeats", str(args.repeats)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"process {role} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench(args, name: str, model_dir: Path, tmp: Path) -> None:
    try:
        url, stop = start_store(name, tmp / name)
    except RuntimeError as e:
        print(f"{name}: skipped: {e}")
        return
    try:
        a = child(args, "first", url, model_dir)
        stored = args.prompt_tokens // args.chunk
        if a["written"] != stored or a["errors"] or a["dropped"]:
            raise RuntimeError(f"{name}: process A wrote {a['written']:.0f} of {stored} chunks "
                               f"({a['errors']:.0f} errors, {a['dropped']:.0f} dropped)")
        report(args, name, "", child(args, "second", url, model_dir))
        for rtt_ms, mbps in args.link:
            if name == "mooncake":
                print(f"{name} over a link: skipped (a relay covers one port only)")
                break
            store = urlsplit(url)
            link = SlowLink((store.hostname, store.port), rtt_ms, mbps).start()
            try:
                b = child(args, "second", url.replace(f":{store.port}", f":{link.port}", 1), model_dir)
            finally:
                link.stop()
            report(args, name, f" over a link of {rtt_ms:g} ms RTT, {mbps:g} MB/s", b)
    finally:
        stop()


def report(args, name: str, where: str, b: dict) -> None:
    n = args.prompt_tokens
    t_rem, t_rec, t_tail = b["remote"], b["recompute"], b["tail"]
    gbps = b["bytes"] / b["get"] / 1e9
    floor = b["get"] + t_tail
    print(f"{name}{where}: TTFT recompute {t_rec * 1e3:.0f} ms vs second instance via {name} "
          f"{t_rem * 1e3:.0f} ms ({b['hit']} of {n} tokens loaded): "
          f"recompute/remote = {t_rec / t_rem:.1f}x")
    print(f"{name}{where} floor: {b['bytes'] / 1e6:.0f} MB / {gbps:.2f} GB/s get + tail "
          f"{t_tail * 1e3:.0f} ms = {floor * 1e3:.0f} ms; remote/floor = {t_rem / floor:.2f}x")


def link_list(text: str) -> list[tuple[float, float]]:
    """"20:100,2:1000" -> [(20.0, 100.0), (2.0, 1000.0)]: round trips in ms, MB/s."""
    try:
        links = [tuple(float(x) for x in item.split(":")) for item in text.split(",") if item]
        assert all(len(x) == 2 and x[0] >= 0 and x[1] > 0 for x in links)
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(
            f"--link wants RTT_MS:MB_PER_S[,...] with RTT >= 0 and MB/s > 0, not {text!r}") from None
    return links


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help=f"comma-separated, of {', '.join(BACKENDS)} (default: all)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--model", help=MODEL_HELP)
    ap.add_argument("--chunk", type=int, default=256, help="lmkv chunk_size (tokens)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    ap.add_argument("--link", type=link_list, default=[], metavar="RTT_MS:MB_PER_S,...",
                    help="also load through a relay with this round trip and bandwidth, "
                         "e.g. 2:1000,20:100 (redis and lm)")
    ap.add_argument("--role", choices=("first", "second"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        run = first_instance if args.role == "first" else second_instance
        print(json.dumps(run(args)))
        return
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    for name in names:
        if name not in BACKENDS:
            ap.error(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    model_dir = bench_model(args.model)
    print(f"{model_dir.name}, prompt {args.prompt_tokens} tokens, chunk {args.chunk}, "
          f"{args.repeats} repeats; recompute = the same prompt in an engine without lmkv, "
          f"in the same process")
    with tempfile.TemporaryDirectory(prefix="lmkv-remote-ttft-") as tmp:
        for name in names:
            bench(args, name, model_dir, Path(tmp))


if __name__ == "__main__":
    main()
