from python_backends.serving.preprocessing import PreprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
