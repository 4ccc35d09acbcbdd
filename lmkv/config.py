"""LMKVConfig: lmkv's settings, loaded in one place.

Precedence: defaults < YAML file named by LMKV_CONFIG_FILE (else LMCache's
LMCACHE_CONFIG_FILE) < LMCACHE_<KEY> < LMKV_<KEY> environment variables < explicit
overrides. Key names follow LMCache's where the meaning is the same, so an LMCache user's
YAML and environment work. Unknown keys and bad values fail at load, naming the key.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .policy import DEFAULT_POLICY, POLICIES

log = logging.getLogger(__name__)

CONFIG_FILE_ENV = "LMKV_CONFIG_FILE"
ENV_PREFIX = "LMKV_"
# LMCache's environment, read where lmkv's own says nothing (a vLLM deployment moved from
# LMCacheConnectorV1 to lmkv's connector keeps it): its config file and LMCACHE_<KEY>
LMCACHE_CONFIG_FILE_ENV, LMCACHE_PREFIX = "LMCACHE_CONFIG_FILE", "LMCACHE_"
# LMKV_* variables that are not keys
_NOT_KEYS = {"CONFIG_FILE", "CACHE_DIR", "TEST_CACHE_DIR", "NATIVE_DECODE", "NATIVE_COPY", "NATIVE_ATTENTION",
             "CODEC_PRODUCT", "LMCACHE_VENV", "EXTRAS", "CUDA_KERNELS"}
MAX_SIZE_GB = 1e6  # sizes beyond this are a typo, not a machine


DEFAULT_CHECK_EVERY = 16  # the quality gate's sampling rate when a lossy codec is on


class ConfigError(ValueError):
    """A bad lmkv configuration; the message names the key."""


@dataclass(frozen=True)
class LMKVConfig:
    chunk_size: int = 256  # tokens per stored chunk
    local_cpu: bool = True  # the hot CPU cache
    max_local_cpu_size: float = 5.0  # GB of the hot CPU cache
    cache_policy: str = DEFAULT_POLICY  # a name in lmkv.policy.POLICIES: what the hot cache evicts
    local_disk: str | None = None  # directory (or file:// URL) of the disk tier; None = off
    max_local_disk_size: float = 0.0  # GB cap of the disk tier (required when local_disk is set)
    remote_url: str | None = None  # lm://, redis://, rediss://, redis-cluster://, mooncakestore:// (shared)
    remote_serde: str = "raw"  # raw (LMCache's "naive" is read as raw) | zstd | cachegen (lossy)
    local_disk_codec: str = "raw"  # raw | zstd | cachegen: how chunks are written to disk
    local_disk_direct: bool = True  # read cold disk-tier files with O_DIRECT (around the page cache)
    # the cachegen table file; None = $LMKV_CACHE_DIR (default ~/.cache/lmkv)/calibration/<scope>
    cachegen_calibration: str | None = None
    # quality gate: re-run 1 in N greedy requests served lossy KV; None = 16 with a lossy
    # codec configured, else off; 0 = off
    codec_check_every: int | None = None
    # below this greedy-token agreement, lossy tiers turn lossless (docs/codec.md: set from
    # benchmarks/codec_rag.py on SmolLM2, between the default target's and a harmful one's)
    codec_min_agreement: float = 0.35
    remote_timeout: float = 2.0  # seconds for any one remote call
    save_decode_cache: bool = False  # also store chunks completed by generated tokens
    kv_role: str = "both"  # both | producer (save only, flushed per request) | consumer (load only)
    use_layerwise: bool = False  # load/save layer by layer, overlapping the forward pass
    # also store a prompt's partial last chunk, found only by the same prompt again (LMCache's
    # key; off by default, as there)
    save_unfull_chunk: bool = False
    enable_prefetch: bool = True  # pull lower-tier chunks of queued requests up early
    cache_salt: str = ""  # namespace: entries of different salts never meet
    io_queue_size: int = 256  # pending background writes/prefetches before dropping
    enable_blending: bool = False
    blend_recompute_ratio: float = 0.15
    blend_special_str: str = " # # "
    blend_check_layer: int = 1  # layer whose KV deviation picks the tokens to recompute
    blend_store_pre_rope: bool = False  # RAG chunks store keys before RoPE (CachedAttention)
    metrics_port: int = 0  # also serve lmkv's metrics at http://metrics_host:PORT/metrics; 0 = off
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _require(self.chunk_size >= 1, "chunk_size", "must be >= 1")
        _require(0 < self.max_local_cpu_size <= MAX_SIZE_GB, "max_local_cpu_size",
                 f"must be > 0 and at most {MAX_SIZE_GB:g} (GB)")
        if isinstance(self.cache_policy, str):  # LMCache writes LRU
            object.__setattr__(self, "cache_policy", self.cache_policy.lower())
        _require(self.cache_policy in POLICIES, "cache_policy",
                 f"must be one of {', '.join(POLICIES)}, got {self.cache_policy!r}")
        _require(0 <= self.max_local_disk_size <= MAX_SIZE_GB, "max_local_disk_size",
                 f"must be >= 0 and at most {MAX_SIZE_GB:g} (GB)")
        _require(self.io_queue_size >= 1, "io_queue_size", "must be >= 1")
        _require(self.kv_role in ("both", "producer", "consumer"), "kv_role",
                 "must be one of both, producer, consumer")
        _require(0 <= self.blend_recompute_ratio <= 1, "blend_recompute_ratio", "must be in [0, 1]")
        _require(self.remote_serde in ("naive", "raw", "zstd", "cachegen"), "remote_serde",
                 "must be one of raw, zstd, cachegen (LMCache's naive is read as raw)")
        if self.remote_serde == "naive":  # LMCache's name for the raw codec
            object.__setattr__(self, "remote_serde", "raw")
        _require(self.local_cpu or self.local_disk is not None or self.remote_url is not None,
                 "local_cpu", "may be false only with local_disk or remote_url set (it keeps "
                 "no chunk in CPU memory: the tiers below serve every hit)")
        if self.cachegen_calibration:  # (~/tables/x.safetensors, as local_disk takes ~)
            object.__setattr__(self, "cachegen_calibration", os.path.expanduser(self.cachegen_calibration))
        if self.local_disk is not None:
            path = os.path.expanduser(self.local_disk.removeprefix("file://"))  # (~/cache)
            _require(bool(path), "local_disk", "must be a directory path")
            _require("," not in path, "local_disk", "takes one directory (LMCache's list of "
                     "several, comma-separated, is not supported)")
            _require(self.max_local_disk_size > 0, "max_local_disk_size",
                     "must be > 0 (GB) when local_disk is set")
            object.__setattr__(self, "local_disk", path)
        if self.remote_url is not None:
            from .backends.registry import check_url

            try:
                check_url(self.remote_url)
            except ValueError as e:
                raise ConfigError(f"lmkv config key remote_url: {e}") from None
        _require(self.local_disk_codec in ("raw", "zstd", "cachegen"), "local_disk_codec",
                 "must be one of raw, zstd, cachegen")
        _require(self.codec_check_every is None or self.codec_check_every >= 0,
                 "codec_check_every", "must be >= 0 (0 = off) or null (on with a lossy codec)")
        _require(0 <= self.codec_min_agreement <= 1, "codec_min_agreement", "must be in [0, 1]")
        _require(0.001 <= self.remote_timeout <= 3600, "remote_timeout",  # (NaN fails too)
                 "must be in [0.001, 3600] seconds")
        _require(self.blend_check_layer >= 1, "blend_check_layer", "must be >= 1 (the first "
                 "layer's KV does not depend on the context: its deviation would pick the "
                 "tokens to recompute at random)")
        _require(bool(self.blend_special_str), "blend_special_str", "must not be empty")
        _require(0 <= self.metrics_port <= 65535, "metrics_port", "must be a TCP port (0 = off)")
        _require(bool(self.metrics_host) and self.metrics_host.count(":") != 1, "metrics_host",
                 "must be a host name or address, without a port (that is metrics_port)")

    @property
    def hot_cache_bytes(self) -> int:
        return int(self.max_local_cpu_size * 1e9)

    @property
    def uses_cachegen(self) -> bool:
        return self.local_disk_codec == "cachegen" or (
            self.remote_url is not None and self.remote_serde == "cachegen")

    def describe(self) -> str:
        """One line naming the tiers and their bounds, for start-up logs."""
        tiers = [f"hot cache {self.max_local_cpu_size:g} GB" if self.local_cpu
                 else f"CPU staging only ({self.max_local_cpu_size:g} GB)"]
        if self.local_disk:
            # (only raw frames are read straight into the slots, with O_DIRECT)
            reads = ", O_DIRECT reads" if self.local_disk_direct and self.local_disk_codec == "raw" else ""
            tiers.append(f"disk {self.local_disk} ({self.max_local_disk_size:g} GB, "
                         f"{self.local_disk_codec}{reads})")
        if self.remote_url:
            from .backends.registry import redact_url

            tiers.append(f"remote {redact_url(self.remote_url)} ({self.remote_serde})")
        extras = [name for name, on in (("layer-wise", self.use_layerwise),
                                        ("blending", self.enable_blending),
                                        (f"role {self.kv_role}", self.kv_role != "both")) if on]
        return (f"chunks of {self.chunk_size} tokens; tiers: {', '.join(tiers)}"
                + (f"; {', '.join(extras)}" if extras else ""))

    @property
    def quality_check_every(self) -> int:
        """1 in how many greedy requests served lossy KV the quality gate re-runs (0: off,
        as it is without a lossy codec: no request is served lossy KV)."""
        if not self.uses_cachegen:
            return 0
        return DEFAULT_CHECK_EVERY if self.codec_check_every is None else self.codec_check_every

    @property
    def disk_bytes(self) -> int:
        return int(self.max_local_disk_size * 1e9)


def load_config(
    path: str | Path | None = None, env: dict[str, str] | None = None, **overrides: Any
) -> LMKVConfig:
    """Build the config: defaults < YAML ``path`` (default: $LMKV_CONFIG_FILE, else LMCache's
    $LMCACHE_CONFIG_FILE) < LMCACHE_<KEY> env for lmkv's keys < LMKV_<KEY> env < overrides."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    path = path or env.get(CONFIG_FILE_ENV) or env.get(LMCACHE_CONFIG_FILE_ENV)
    if path:  # (LMCache's spellings are read per source, so that precedence holds for them)
        values.update(_lmcache_blend_keys(read_yaml(Path(path))))
    for prefix, names in ((LMCACHE_PREFIX, _lmcache_keys_in_env(env)), (ENV_PREFIX, keys_in_env(env))):
        given = {}
        for name in names:
            key = name[len(prefix):].lower()
            given[key] = _parse_env(key, env[name], prefix)
        values.update(_lmcache_blend_keys(given))
    values.update(_lmcache_blend_keys(overrides))
    lmcache = [name for name in (LMCACHE_CONFIG_FILE_ENV,) if path and path == env.get(name)]
    lmcache += _lmcache_keys_in_env(env)
    try:
        return from_dict(values)
    except ConfigError as e:
        if not lmcache:
            raise
        raise ConfigError(f"{e} (LMCache's settings were read too: {', '.join(lmcache)})") from None


def _lmcache_keys_in_env(env: dict[str, str]) -> list[str]:
    """The LMCACHE_<KEY> variables that name lmkv's keys (LMCache's blend lists included);
    said once per process, with those it does not read."""
    names = sorted(n for n in env if n.startswith(LMCACHE_PREFIX) and n != LMCACHE_CONFIG_FILE_ENV)
    known = _FIELDS.keys() | {"blend_recompute_ratios", "blend_check_layers", "blend_thresholds",
                              "blend_min_tokens"}
    read = [n for n in names if n[len(LMCACHE_PREFIX):].lower() in known]
    file = env.get(LMCACHE_CONFIG_FILE_ENV) if not env.get(CONFIG_FILE_ENV) else None
    if names or file:
        _tell_lmcache(tuple(read), tuple(n for n in names if n not in read), file)
    return read


@functools.cache  # (once per process for each LMCache environment)
def _tell_lmcache(read: tuple[str, ...], ignored: tuple[str, ...], file: str | None) -> None:
    if file:
        log.info("lmkv: reading LMCache's config file %s (LMCACHE_CONFIG_FILE; LMKV_CONFIG_FILE "
                 "takes precedence)", file)
    if read:
        log.info("lmkv: reading LMCache's %s (an LMKV_<KEY> of the same key takes precedence)",
                 ", ".join(read))
    if ignored:
        log.warning("lmkv: LMCache's %s %s no lmkv setting: not used", ", ".join(ignored),
                    "names" if len(ignored) == 1 else "name")


def keys_in_env(env: dict[str, str] | None = None) -> list[str]:
    """The LMKV_* variables set that name config keys (what a load_config would use)."""
    env = dict(os.environ) if env is None else env
    return sorted(name for name in env
                  if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):] not in _NOT_KEYS)


def off_but_configured(env: dict[str, str] | None = None) -> str | None:
    """With LMKV_CONFIG_FILE unset (lmkv off in the bundled engine) but LMKV_<KEY> variables
    or LMCache's config file set: a warning that names them, else None."""
    env = dict(os.environ) if env is None else env
    stray = [] if env.get(CONFIG_FILE_ENV) else keys_in_env(env) + [
        name for name in (LMCACHE_CONFIG_FILE_ENV,) if env.get(name)]
    if not stray:
        return None
    return (f"lmkv is off: LMKV_CONFIG_FILE is not set, so {', '.join(stray)} "
            f"{'is' if len(stray) == 1 else 'are'} not used (LMKV_CONFIG_FILE turns lmkv on; "
            "an empty YAML file takes every setting from these variables)")


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read lmkv config file {path}: {e.strerror or e}") from e
    try:
        data = yaml.load(text, Loader=_unique_keys_loader())  # (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"lmkv config file {path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"lmkv config file {path} must be a mapping of keys to values")
    if bad := [k for k in data if not isinstance(k, str)]:
        raise ConfigError(f"lmkv config file {path}: keys must be names, found "
                          f"{', '.join(map(repr, bad))} (YAML reads on, off, yes, no and "
                          "numbers as booleans and numbers: quote such a key)")
    return data


@functools.cache
def _unique_keys_loader():
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the
    last: a key copied into a file and changed in one place only)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # (<<: the mapping merged in)
                continue
            key = loader.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # (a list as a key: the loader refuses it next)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found the key {key!r} twice",
                    key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


_FIELDS = {f.name: f for f in fields(LMKVConfig)}
_HINTS = typing.get_type_hints(LMKVConfig)


def from_dict(values: dict[str, Any]) -> LMKVConfig:
    unknown = sorted(set(values) - set(_FIELDS), key=str)
    if unknown:
        raise ConfigError(
            f"unknown lmkv config key(s): {', '.join(map(str, unknown))} "
            f"(known: {', '.join(sorted(_FIELDS))})"
        )
    return LMKVConfig(**{k: _coerce(k, v) for k, v in values.items()})


def _lmcache_blend_keys(values: dict[str, Any]) -> dict[str, Any]:
    """LMCache's blend keys read as lmkv's: its lists ``blend_recompute_ratios`` and
    ``blend_check_layers`` of one value each (lmkv blends with one ratio, picked at one
    layer); ``blend_thresholds`` null and ``blend_min_tokens``, which LMCache 0.5 reads
    but does not use."""
    out = dict(values)
    for plural, single in (("blend_recompute_ratios", "blend_recompute_ratio"),
                           ("blend_check_layers", "blend_check_layer")):
        if plural not in out:
            continue
        value = out.pop(plural)
        if value is None:
            continue
        _require(isinstance(value, list) and len(value) == 1, plural,
                 f"(LMCache's) must be a list of one value: lmkv blends with one "
                 f"{single} (got {value!r})")
        _require(single not in out, plural, f"and {single} are both set: give one")
        out[single] = value[0]
    _require(out.pop("blend_thresholds", None) is None, "blend_thresholds",
             "is not supported: lmkv recomputes blend_recompute_ratio of the tokens")
    out.pop("blend_min_tokens", None)
    return out


def _coerce(key: str, value: Any) -> Any:
    hint = _HINTS[key]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
    want = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"lmkv config key {key}: expected {want}, got {value!r}")


def _parse_env(key: str, raw: str, prefix: str = ENV_PREFIX) -> Any:
    name = f"{prefix}{key.upper()}"
    if key in ("blend_recompute_ratios", "blend_check_layers"):  # (LMCache's lists: 0.15 or [0.15])
        values = [v.strip() for v in raw.strip().strip("[]").split(",")]
        single = key.removesuffix("s")
        if len(values) != 1:
            raise ConfigError(f"lmkv config key {key} ({name}) must be one value: lmkv blends "
                              f"with one {single} (got {raw!r})")
        try:
            return [float(values[0]) if single == "blend_recompute_ratio" else int(values[0])]
        except ValueError:
            raise ConfigError(f"lmkv config key {key}: cannot parse {name}={raw!r}") from None
    if key in ("blend_thresholds", "blend_min_tokens"):
        return None if raw.lower() in ("", "none", "null") else raw
    if key not in _FIELDS:
        raise ConfigError(f"unknown lmkv config key {key} (from environment {name})")
    hint = _HINTS[key]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if raw.lower() in ("", "none", "null") and type(None) in allowed:
        return None
    if bool in allowed:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
    if int in allowed and re.fullmatch(r"-?\d+", raw):
        return int(raw)
    if float in allowed:
        try:
            return float(raw)
        except ValueError:
            pass
    if str in allowed:
        return raw
    raise ConfigError(f"lmkv config key {key}: cannot parse {name}={raw!r}")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"lmkv config key {key} {message}")
