from python_backends.serving.front import FrontModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
