"""lmkv.cc, the native builds' cache: keyed by the CPU the build is for (x86 and ARM alike),
readable by the others sharing the cache, and $CC taken as a command line."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from lmkv import cc

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

ARM = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32{}\n"


def test_arm_cpus_with_other_features_get_other_builds(monkeypatch):
    cpuinfo = {"text": ""}
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: cpuinfo["text"]
                        if str(self) == "/proc/cpuinfo" else real(self, *a, **k))
    keys = []
    for extra in ("", " sve sve2"):
        cpuinfo["text"] = ARM.format(extra)
        keys.append(cc._cpu_flags())
    assert keys[0] != keys[1] and "sve" in keys[1]


@needs_cc
def test_a_build_is_readable_by_others_and_cc_may_carry_arguments(monkeypatch, tmp_path):
    source = tmp_path / "one.c"
    source.write_text("int lmkv_one(void) { return 1; }\n")
    compiler = shutil.which("cc") or shutil.which("gcc")
    monkeypatch.setenv("CC", f"{compiler} -Wall")
    old = os.umask(0o022)
    try:
        path = cc.build(cc.compiler(), source, tmp_path / "out")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode & 0o044 == 0o044, oct(mode)
    assert [p.name for p in (tmp_path / "out").iterdir()] == [path.name]  # no temporary left


@pytest.mark.parametrize("value,off", [("0", True), ("false", True), ("Off", True), ("no", True),
                                       ("1", False), ("", False)])
def test_native_code_is_switched_off_by_any_usual_spelling(monkeypatch, value, off):
    monkeypatch.setenv("LMKV_NATIVE_COPY", value)
    assert cc.switched_off("LMKV_NATIVE_COPY") is off
