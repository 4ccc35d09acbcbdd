"""Compile gate: every kernel instantiation of cuda/ builds with NVRTC (the run-time path that
CuPy's RawModule takes on users' GPUs) and with nvcc, whose ptxas report must show no register
spills and shared memory within the per-block limit. Skipped when the tools are missing; CI
installs them (see docs/kernels.md). The nvcc builds run two at a time in background
threads from the module's start, beside NVRTC compiling in this process;
with them, NVRTC stops at PTX (its front end: where it differs from nvcc), else it runs
ptxas too (to CUBIN)."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from lmkv_cuda import INSTANTIATIONS, SOURCE_DIR, read_source

ARCHS = ["sm_80", "sm_90"]
STATIC_SMEM_LIMIT = 48 * 1024  # bytes of static __shared__ per block
THREADS = {  # block size of each kernel (the merge kernel: head_dim threads, at most 128)
    "kv_copy": 256, "rerotate_keys": 256, "paged_attention": 128, "paged_attention_merge": 128,
    "paged_decode_warps": 128,
    "cachegen_quantize": 256, "cachegen_dequantize": 256,
}  # fmt: skip


def _nvrtc_include() -> Path | None:
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for sub in ("cu13/include", "cuda_runtime/include"):
            if (Path(root) / sub / "cuda_fp16.h").exists():
                return Path(root) / sub
    return None


@pytest.fixture(scope="module")
def nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:  # ImportError, or the NVRTC library not found
        pytest.skip(f"NVRTC unavailable ({e}): pip install cupy-cuda13x nvidia-cuda-nvrtc")
    include = _nvrtc_include()
    if include is None:
        pytest.skip("CUDA headers missing: pip install nvidia-cuda-runtime")
    return nvrtc, include


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file", sorted(INSTANTIATIONS))
def test_nvrtc(nvrtc, file, arch, nvcc_builds):
    lib, include = nvrtc
    names = INSTANTIATIONS[file]
    prog = lib.createProgram(read_source(file), file, [], [])
    target = arch.replace("sm_", "compute_") if nvcc_builds is not None else arch  # PTX / CUBIN
    try:
        for name in names:
            lib.addNameExpression(prog, name)
        options = [f"--gpu-architecture={target}", "-std=c++17", f"-I{include}", f"-I{SOURCE_DIR}"]
        try:
            lib.compileProgram(prog, options)
        except Exception as e:
            pytest.fail(f"NVRTC {arch} {file}: {e}\n{lib.getProgramLog(prog)}")
        log = lib.getProgramLog(prog).strip()
        assert "warning" not in log.lower(), log
        assert len(lib.getPTX(prog) if target != arch else lib.getCUBIN(prog)) > 0
        lowered = [lib.getLoweredName(prog, n) for n in names]
        assert len(set(lowered)) == len(names)
    finally:
        lib.destroyProgram(prog)


class _NvccBuilds:
    """Every (file, arch) built by nvcc -cubin with the ptxas report, in a background thread."""

    def __init__(self, tmp: Path, threads: int = 2):
        self.tmp = tmp
        self.results: dict[tuple[str, str], subprocess.CompletedProcess] = {}
        self.done = {(f, a): threading.Event() for f in sorted(INSTANTIATIONS) for a in ARCHS}
        # the largest first: with two builds at once they need not wait for each other
        self._todo = sorted(self.done, key=lambda fa: -len(INSTANTIATIONS[fa[0]]))
        self._lock = threading.Lock()
        for i in range(threads):
            threading.Thread(target=self._run, name=f"nvcc-builds-{i}", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._todo:
                    return
                file, arch = self._todo.pop(0)
            try:
                self.results[file, arch] = self._build(file, arch)
            finally:
                self.done[file, arch].set()

    def _build(self, file: str, arch: str) -> subprocess.CompletedProcess:
        unit = self.tmp / f"gate_{file}"
        refs = "".join(f"    (void*)&{n},\n" for n in INSTANTIATIONS[file])
        unit.write_text(f'#include "{file}"\nvoid* lmkv_instances[] = {{\n{refs}}};\n')
        cmd = [
            "nvcc", f"-arch={arch}", "-cubin", "-std=c++17", "-Xptxas", "-v", "-Werror", "all-warnings",
            f"-I{SOURCE_DIR}", str(unit), "-o", str(self.tmp / f"{file}.{arch}.cubin"),
        ]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True)

    def report(self, file: str, arch: str) -> dict[str, dict[str, int]]:
        """{demangled kernel: {registers, smem, stack, spill_stores, spill_loads}}."""
        assert self.done[file, arch].wait(timeout=600), f"nvcc {file} {arch} did not finish"
        r = self.results.get((file, arch))
        assert r is not None, f"nvcc {file} {arch} failed to run"
        assert r.returncode == 0, r.stderr
        report: dict[str, dict[str, int]] = {}
        current = None
        for line in r.stderr.splitlines():
            if m := re.search(r"Function properties for (\S+)", line):
                current = m.group(1)
                report[current] = {}
            elif current and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)):  # noqa: E501
                report[current].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
            elif current and (m := re.search(r"Used (\d+) registers", line)):
                smem = re.search(r"(\d+) bytes smem", line)
                report[current].update(registers=int(m[1]), smem=int(smem[1]) if smem else 0)
        names = subprocess.run(["c++filt"], input="\n".join(report), capture_output=True, text=True)
        return dict(zip(names.stdout.split("\n"), report.values(), strict=False))


@pytest.fixture(scope="module", autouse=True)
def nvcc_builds(tmp_path_factory):
    if shutil.which("nvcc") is None or shutil.which("c++filt") is None:
        return None
    return _NvccBuilds(tmp_path_factory.mktemp("nvcc"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file", sorted(INSTANTIATIONS))
def test_ptxas_no_spills(file, arch, nvcc_builds):
    if nvcc_builds is None:
        pytest.skip("nvcc (CUDA toolkit) and c++filt (binutils) are needed for the ptxas report")
    report = nvcc_builds.report(file, arch)
    assert len(report) == len(INSTANTIATIONS[file]), sorted(report)
    for kernel, stats in report.items():
        base = re.match(r"void (\w+)<", kernel)[1]
        assert stats["spill_stores"] == 0 and stats["spill_loads"] == 0, (kernel, stats)
        assert stats["smem"] <= STATIC_SMEM_LIMIT, (kernel, stats)
        assert stats["registers"] * THREADS[base] <= 64 * 1024, (kernel, stats)
        # a stack frame without spills is sincosf's slow path (rope) only
        assert stats["stack"] == 0 or base == "rerotate_keys", (kernel, stats)
