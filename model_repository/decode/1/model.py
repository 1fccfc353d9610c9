from python_backends.serving.worker import WorkerModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
