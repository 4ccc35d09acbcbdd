"""Reading ``LMKV_CONFIG_FILE`` for ``engine serve``.

lmkv itself is not part of this build yet: an empty file means "lmkv disabled", and any
key at all is a startup error. The real lmkv config loader replaces this function.
"""

from __future__ import annotations

from pathlib import Path

import yaml


def load_lmkv_config(path: str | Path) -> None:
    """Check the YAML file at ``path``; returns None (lmkv disabled) or raises ValueError
    saying why the server cannot start with it."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"LMKV_CONFIG_FILE={path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"LMKV_CONFIG_FILE={path} cannot be read: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"LMKV_CONFIG_FILE={path} is not valid YAML: {e}") from None
    if data is None:
        return None  # an empty file: lmkv disabled
    if not isinstance(data, dict):
        raise ValueError(
            f"LMKV_CONFIG_FILE={path} must hold a mapping of lmkv settings, "
            f"not a {type(data).__name__}"
        )
    if data:
        keys = ", ".join(sorted(map(str, data)))
        raise ValueError(
            f"LMKV_CONFIG_FILE={path} enables lmkv ({keys}), which this build does not "
            "include yet; unset LMKV_CONFIG_FILE to serve without lmkv"
        )
    return None
