from python_backends.serving.generator import GeneratorModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
