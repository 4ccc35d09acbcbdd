"""Precompute as a user meets it (from a review): what it reports stored is stored, and found."""

from __future__ import annotations

import torch

from lmkv.config import load_config
from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _blend_llm(model_dir, **kw):
    cfg = load_config(env={}, **{"chunk_size": 32, "max_local_cpu_size": 0.05, "enable_blending": True,
                                 "blend_recompute_ratio": 0.15, **kw})
    return LLM(str(model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20, enable_prefix_caching=False)


def test_a_document_counted_stored_is_found_by_a_prompt_built_from_it(tiny_model_dir):
    """With blend_special_str "\\n\\n" (the blank line docs/configuration.md describes), a
    document that ends in a line end (`open(f).read()`, or a file ending in a blank line
    through `engine precompute` without --split-on) is counted stored, but every prompt
    built as [prefix] SEP doc SEP query splits "doc\\n" + "\\n\\n" at its first "\\n\\n":
    the part is "doc", the stored "doc\\n" is never looked up. Counted stored, never reused."""
    doc = "Melk is the capital of Zorvia, famous for its old bridges.\n"
    with _blend_llm(tiny_model_dir, blend_special_str="\n\n") as llm:
        clean = "The river Tal flows through Zorvia."  # the control: no line end, found
        llm.precompute([clean], progress=False)
        ok = llm.generate(["\n\n".join(["Answer from the documents.", clean, "Q: A:"])], GREEDY)[0]
        assert ok.num_external_tokens > 0
        report = llm.precompute([doc], progress=False)
        prompt = "\n\n".join(["Answer from the documents.", doc, "Q: What is the capital? A:"])
        out = llm.generate([prompt], GREEDY)[0]
        # either refused (named, failed) or reused: never "stored" and unreachable
        assert report.stored == 0 or out.num_external_tokens > 0, (report, out.num_external_tokens)


def test_cli_a_file_ending_in_a_blank_line_is_stored_as_prompts_hold_it(tiny_model_dir, tmp_path,
                                                                       monkeypatch):
    """`engine precompute FILE` (one chunk per file) drops only the file's last line end: a
    file that ends in a blank line, as many do, is stored as "text\n". With --split-on the
    same file gives "text" (line ends around parts are dropped). With blend_special_str
    "\n\n", "text\n" is unreachable by any prompt (previous test); with " # # " it is found
    only by a prompt that keeps the stray line end."""
    from lmkv_engines.minimal import cli

    cfg = tmp_path / "l.yaml"
    cfg.write_text(f"chunk_size: 32\nmax_local_cpu_size: 0.05\nlocal_disk: {tmp_path / 'd'}\n"
                   "max_local_disk_size: 0.1\nenable_blending: true\nblend_special_str: \"\\n\\n\"\n")
    (tmp_path / "doc.txt").write_text("Alpha is the first letter.\n\n", encoding="utf-8")
    monkeypatch.setenv("LMKV_CONFIG_FILE", str(cfg))
    assert cli.main(["precompute", "--model", str(tiny_model_dir), "--kv-cache-memory", "32MiB",
                     str(tmp_path / "doc.txt")]) == 0
    with _blend_llm(tiny_model_dir, blend_special_str="\n\n", local_disk=str(tmp_path / "d"),
                    max_local_disk_size=0.1) as llm:
        prompt = "\n\n".join(["Answer.", (tmp_path / "doc.txt").read_text().strip(), "Q: A:"])
        assert llm.generate([prompt], GREEDY)[0].num_external_tokens > 0


def _many_docs(seed: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (length,), generator=g).tolist() for _ in range(n)]


def test_a_corpus_past_the_disk_cap_is_not_reported_stored(tiny_model_dir, tmp_path):
    """Each batch is counted stored once its writes reach the disk tier, but later batches
    evict earlier ones for the tier's size cap (max_local_disk_size): the report (and the
    CLI's summary line and exit 0) say every chunk is stored while the disk holds a
    fraction, and a server started later finds only those. With no tier below, the same
    loss from the hot cache is recounted at the end (test_precompute_past_the_hot_cache_...)."""
    docs = _many_docs(21, n=60, length=32)
    with _blend_llm(tiny_model_dir, local_disk=str(tmp_path / "d"), max_local_disk_size=0.001) as llm:
        report = llm.precompute(docs, batch_size=8, progress=False)
        disk = llm.engine.kv_connector.cache.storage.tiers[0]
        cache = llm.engine.kv_connector.cache
        on_disk = sum(all(disk.contains(cache.content_keys(d))) for d in docs)
    assert on_disk < len(docs)
    assert report.stored == on_disk and report.failed == len(docs) - on_disk, (report, on_disk)


def test_cli_one_file_that_is_not_utf8_does_not_drop_the_rest(tiny_model_dir, tmp_path, monkeypatch,
                                                              capsys):
    """The not-UTF-8 error is raised inside the generator precompute reads: it unwinds
    precompute itself, so the chunks of the good files read before it (in the batch not yet
    computed) are dropped without a word, the files after it are never read, and no
    summary line is printed. The docs say the command names such a file and exits 1 if any
    chunk failed: the others should be stored (and counted)."""
    from lmkv_engines.minimal import cli

    cfg = tmp_path / "l.yaml"
    cfg.write_text(f"chunk_size: 32\nmax_local_cpu_size: 0.05\nlocal_disk: {tmp_path / 'd'}\n"
                   "max_local_disk_size: 0.1\nenable_blending: true\n")
    (tmp_path / "a.txt").write_text("Alpha is the first letter.\n")
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 latin-1\n")
    (tmp_path / "c.txt").write_text("Gamma is the third letter.\n")
    monkeypatch.setenv("LMKV_CONFIG_FILE", str(cfg))
    rc = cli.main(["precompute", "--model", str(tiny_model_dir), "--kv-cache-memory", "32MiB",
                   *(str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt"))])
    err = capsys.readouterr()
    assert rc == 1 and "b.txt is not UTF-8 text" in err.err
    with _blend_llm(tiny_model_dir, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1) as llm:
        cache = llm.engine.kv_connector.cache
        held = [cache.has_chunk(llm.engine.tokenize(t, add_special_tokens=False))
                for t in ("Alpha is the first letter.", "Gamma is the third letter.")]
    assert held == [True, True], (held, err.out)


def test_a_batch_with_more_pieces_than_the_hot_cache_holds_waits_for_a_slow_tier(tiny_model_dir,
                                                                                 tmp_path):
    """precompute waits for the writes below batch by batch, but within a batch every
    piece of every document is computed, then put into the hot cache one after another
    before any wait: where a batch has more pieces (8 documents x 7 chunks here) than the
    hot cache has slots (30, three max_model_len prompts), the hot cache drops the queued
    writes for slots and those documents count failed, although the disk tier has room and
    works. With a real model (32 MB chunks, a 5 GB hot cache: ~150 slots) 8 documents of 8k
    tokens are 256 pieces."""
    import time

    docs = _many_docs(22, n=16, length=224)  # 7 pieces of 32 tokens each
    cfg = load_config(env={}, chunk_size=32, max_local_cpu_size=0.001, enable_blending=True,
                      local_disk=str(tmp_path), max_local_disk_size=1)  # 30 slots
    # max_model_len 256: the hot cache holds 3 whole prompts (no warning at start)
    with LLM(str(tiny_model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20, max_model_len=256,
             enable_prefix_caching=False) as llm:
        backend = llm.engine.kv_connector.cache.storage.tiers[0].backend
        real = backend.put
        backend.put = lambda items: (time.sleep(0.01), real(items))[1]
        report = llm.precompute(docs, batch_size=8, progress=False)
    assert (report.stored, report.failed) == (len(docs), 0), report


def test_a_repeat_of_a_document_that_failed_is_not_reported_already_stored(tiny_model_dir):
    """Repeats are skipped by digest before the first copy's fate is known: a document the
    engine refused (longer than max_model_len), given twice, reads "0 stored, 1 already
    stored, 1 failed" in the summary: nothing of it is stored."""
    cfg = load_config(env={}, chunk_size=32, max_local_cpu_size=0.05, enable_blending=True)
    with LLM(str(tiny_model_dir), lmkv_config=cfg, kv_cache_memory=64 << 20, max_model_len=256,
             enable_prefix_caching=False) as llm:
        long = _many_docs(24, n=1, length=300)[0]
        report = llm.precompute([long, long], progress=False)
        assert not llm.engine.kv_connector.cache.has_chunk(long)
    assert report.skipped == 0, report


def test_precompute_asks_the_tiers_once_a_batch_whether_documents_are_stored(tiny_model_dir,
                                                                             tmp_path):
    """Whether a document is stored already (every tier below holds it) and whether a
    batch's writes reached them were asked per document: a remote tier paid a round trip
    for each, 100,000 of them for a corpus run again. One question per tier per batch."""
    docs = _many_docs(25, n=20, length=64)
    with _blend_llm(tiny_model_dir, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1) as llm:
        tier = llm.engine.kv_connector.cache.storage.tiers[0]
        real, calls = tier.contains, []
        tier.contains = lambda keys: (calls.append(len(keys)), real(keys))[1]
        first = llm.precompute(docs, batch_size=8, progress=False)
        asked_first, calls[:] = len(calls), []
        again = llm.precompute(docs, batch_size=8, progress=False)
    assert (first.stored, first.failed) == (20, 0), first
    assert asked_first <= 2 * 3 + 1, asked_first  # per batch: stored already? written? + the end
    assert (again.stored, again.skipped, again.failed) == (0, 20, 0), again
    assert len(calls) <= 3 + 1 and sum(calls) >= 2 * 20, calls
