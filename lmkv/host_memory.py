"""How much memory this process may still fill: the machine's, or a memory cgroup's (a
container, a systemd slice) where one limits it. Free of torch: lmkv_server asks too."""

from __future__ import annotations

from pathlib import Path


def host_memory_available(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process may still fill with memory: the kernel's MemAvailable, or less
    where a memory cgroup (a container, a systemd slice) limits the process or one of the
    groups above it, cgroup v2 or v1 (its limit less what it uses, the page cache it could
    drop not counted as used); None where none of them can be read."""
    found = []
    try:
        with open(f"{proc}/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{proc}/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        lines = []
    for _, controllers, path in lines:
        if controllers == "":  # v2
            base, files = Path(cgroup_root), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            base = Path(cgroup_root) / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        here = base / path.lstrip("/")
        if not here.is_dir():  # (a container's own view: its group is the mount's root)
            here = base
        for group in (here, *here.parents):
            room = _cgroup_room(group, *files)
            if room is not None:
                found.append(room)
            if group == base:
                break
    return min(found) if found else None


def _cgroup_room(group: Path, limit_file: str, used_file: str, inactive: str) -> int | None:
    """A memory cgroup's limit less what it uses (its inactive page cache not counted as
    used), or None where it has no limit or its files cannot be read."""
    try:
        limit = (group / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # (v1 writes "no limit" as ~2**63)
            return None
        used = int((group / used_file).read_text())
        stat = dict(line.split()[:2] for line in (group / "memory.stat").read_text().splitlines()
                    if line.strip())
        return int(limit) - used + int(stat.get(inactive, 0))
    except (OSError, ValueError):
        return None
