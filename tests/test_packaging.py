"""What a wheel of lmkv holds: every package directory and the sources built at run time
(a non-editable install once lacked lmkv's subpackages)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_and_runtime_source_is_in_the_wheel():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]
    listed = set(tool["packages"])
    found = set()
    for name, root in dirs.items():
        for init in (ROOT / root).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / root).parts
            found.add(".".join((name, *rel)))
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    data = tool["package-data"]
    assert "*.c" in data["lmkv.codec"]  # native.c, compiled on first use
    assert (ROOT / "lmkv" / "codec" / "native.c").exists()
    assert "*.c" in data["lmkv"]  # transfer.c, compiled on first use
    assert (ROOT / "lmkv" / "transfer.c").exists()
