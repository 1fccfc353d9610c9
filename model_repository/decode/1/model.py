from python_backends.serving.generator import DecodeModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
