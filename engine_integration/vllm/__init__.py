"""lmkv inside vLLM: a KVConnectorBase_V1 adapter.

Load it with kv_connector_module_path="lmkv_engines.vllm.connector", kv_connector="LMKVConnector".
"""
