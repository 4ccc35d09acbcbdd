"""``python -m lmkv_server``."""

from lmkv_server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
