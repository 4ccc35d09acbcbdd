"""Static instruction count of a kernel's main loop, from its SASS, without a GPU.

    python benchmarks/sass_loop.py [--arch sm_90] [KERNEL ...]

Compiles the given instantiations of cuda/paged_attention.cu with nvcc (-cubin), disassembles
them with cuobjdump (needs cuobjdump and nvdisasm on PATH: the PyPI wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm carry them, under nvidia/cu13/bin) and
counts the instructions of each kernel's longest loop (the span of its longest backward
branch): for a memory-bound kernel whose warps are issue-limited, instructions per loop
step is what a change can cut. Prints one line per kernel, the most frequent opcodes, and
the ratio of each kernel's count to the first kernel's (exit 1 if a kernel or its loop is
not found).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

SOURCE = Path(__file__).resolve().parents[1] / "cuda"
DEFAULT = ["paged_decode_warps<__nv_bfloat16, 128, 4>", "paged_decode_warps<__nv_bfloat16, 128, 4, true>"]
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


class Loop(NamedTuple):
    instructions: int  # 0: no loop found
    opcodes: collections.Counter  # opcode (without modifiers) -> count in the loop


def loop_counts(sass: str) -> dict[str, Loop]:
    """{mangled function: its longest loop}. A loop is the span of a backward branch that
    holds no EXIT: the out-of-line blocks after a kernel's last EXIT (the slow paths of
    shuffles, which BRA.DIV jumps to) branch back into the middle of the loop and are not
    loops themselves."""
    out: dict[str, Loop] = {}
    for chunk in re.split(r"\n\s+Function : ", sass)[1:]:
        name = chunk.split()[0]
        ins = [(int(m[1], 16), m[2]) for line in chunk.splitlines() if (m := _INSTRUCTION.match(line))]
        index = {addr: i for i, (addr, _) in enumerate(ins)}
        exits = [i for i, (_, text) in enumerate(ins) if re.search(r"\bEXIT\b", text)]
        best = (0, 0, -1)
        for i, (addr, text) in enumerate(ins):
            m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
            if not m or int(m[1], 16) >= addr or int(m[1], 16) not in index:
                continue
            start = index[int(m[1], 16)]
            if not any(start <= e <= i for e in exits):
                best = max(best, (i - start + 1, start, i))
        ops: collections.Counter = collections.Counter()
        for _, text in ins[best[1] : best[2] + 1]:
            words = text.split()
            op = words[1] if words[0].startswith("@") else words[0]
            ops[op.split(".")[0]] += 1
        out[name] = Loop(best[0], ops)
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
                           check=True).stdout.splitlines()  # fmt: skip

    def plain(name: str) -> str:  # without spaces; paged_decode_warps' LEAN default spelled out
        name = name.replace("(bool)1", "true").replace("(bool)0", "false").replace(" ", "")
        if name.startswith("paged_decode_warps<") and name.count(",") == 2:
            name = name[:-1] + ",false>"
        return name

    by_name = {plain(re.sub(r"\(.*", "", n).removeprefix("void ")): v
               for n, v in zip(names, counts.values(), strict=True)}  # fmt: skip
    loops = []
    for kernel in args.kernels:
        loop = by_name.get(plain(kernel))
        if loop is None or loop.instructions == 0:
            print(f"{kernel}: {'no loop' if loop else 'not found'} in the disassembly")
            return 1
        loops.append((kernel, loop))
    first = loops[0][1].instructions
    for kernel, loop in loops:
        top = " ".join(f"{op} {c}" for op, c in loop.opcodes.most_common(8))
        print(f"{kernel} ({args.arch}): {loop.instructions} instructions in its main loop ({top}): "
              f"loop/first = {loop.instructions / first:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
