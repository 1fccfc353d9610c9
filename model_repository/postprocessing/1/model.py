from python_backends.serving.postprocessing import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
