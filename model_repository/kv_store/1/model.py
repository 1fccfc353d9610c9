from python_backends.serving.kv_store import KVStoreModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
