"""Engines that lmkv plugs into (installed as ``lmkv_engines``)."""
