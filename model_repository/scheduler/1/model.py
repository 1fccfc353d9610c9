from python_backends.serving.scheduler import SchedulerModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
