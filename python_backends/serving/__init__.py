"""Triton glue: the only code that imports triton_python_backend_utils.

Each module here is one model's `TritonPythonModel`; model_repository/<model>/1/model.py imports
it. They parse tensors into plain Python at the edge and hand off to the rest of the package.
"""
