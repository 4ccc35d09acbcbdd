"""lmkv_server: a standalone cache server speaking the lm:// protocol.

Installed under the import name ``lmkv_server`` (the folder is ``server/``).
"""
