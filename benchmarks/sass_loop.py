"""Static instruction count of a kernel's main loop, from its SASS, without a GPU.

    python benchmarks/sass_loop.py [--arch sm_90] [KERNEL ...]

Compiles the given instantiations of cuda/paged_attention.cu with nvcc (-cubin), disassembles
them with cuobjdump (needs cuobjdump and nvdisasm on PATH: the PyPI wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm carry them, under nvidia/cu13/bin) and
counts the instructions of each kernel's longest loop (the span of its longest backward
branch): for a memory-bound kernel whose warps are issue-limited, instructions per loop
step is what a change can cut. Prints one line per kernel, the most frequent opcodes, and
the ratio of each kernel's count to the first one's.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "cuda"
DEFAULT = ["paged_decode_warps<__nv_bfloat16, 128, 4>", "paged_decode_warps<__nv_bfloat16, 128, 4, true>"]
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def loop_counts(sass: str) -> dict[str, tuple[int, collections.Counter]]:
    """{mangled function: (instructions in its longest loop, opcode counts there)}."""
    out: dict[str, tuple[int, collections.Counter]] = {}
    for chunk in re.split(r"\n\s+Function : ", sass)[1:]:
        name = chunk.split()[0]
        ins = [(int(m[1], 16), m[2]) for line in chunk.splitlines() if (m := _INSTRUCTION.match(line))]
        index = {addr: i for i, (addr, _) in enumerate(ins)}
        best = (0, 0, -1)
        for i, (addr, text) in enumerate(ins):
            m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
            if m and int(m[1], 16) < addr and int(m[1], 16) in index:
                start = index[int(m[1], 16)]
                best = max(best, (i - start + 1, start, i))
        ops = collections.Counter()
        for _, text in ins[best[1] : best[2] + 1]:
            words = text.split()
            op = words[1] if words[0].startswith("@") else words[0]
            ops[op.split(".")[0]] += 1
        out[name] = (best[0], ops)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("kernels", nargs="*", default=DEFAULT)
    args = p.parse_args(argv)
    missing = [t for t in ("nvcc", "cuobjdump", "nvdisasm", "c++filt") if shutil.which(t) is None]
    if missing:
        print(f"needs {', '.join(missing)} on PATH (see the docstring)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "unit.cu"
        refs = "".join(f"    (void*)&{k},\n" for k in args.kernels)
        unit.write_text(f'#include "paged_attention.cu"\nvoid* instances[] = {{\n{refs}}};\n')
        cubin = Path(tmp) / "unit.cubin"
        subprocess.run(["nvcc", f"-arch={args.arch}", "-cubin", "-std=c++17", f"-I{SOURCE}",
                        str(unit), "-o", str(cubin)], check=True)  # fmt: skip
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout  # fmt: skip
    counts = loop_counts(sass)
    names = subprocess.run(["c++filt"], input="\n".join(counts), capture_output=True, text=True,
                           check=True).stdout.split("\n")  # fmt: skip
    def plain(name: str) -> str:  # without spaces and default template arguments
        name = name.replace("(bool)1", "true").replace("(bool)0", "false").replace(" ", "")
        return name.replace(",false>", ">")

    by_name = {plain(re.sub(r"\(.*", "", n).removeprefix("void ")): v
               for n, v in zip(names, counts.values(), strict=False)}  # fmt: skip
    first = None
    for kernel in args.kernels:
        key = plain(kernel)
        if key not in by_name:
            print(f"{kernel}: not found in the disassembly", file=sys.stderr)
            continue
        n, ops = by_name[key]
        first = first or n
        top = " ".join(f"{op} {c}" for op, c in ops.most_common(8))
        print(f"{kernel} ({args.arch}): {n} instructions in its main loop ({top}): "
              f"loop/first = {n / first:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
