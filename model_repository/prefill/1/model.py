from python_backends.serving.prefill import PrefillModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
