"""Disaggregated LLM serving as a Triton Inference Server model repository.

Everything importable lives here; the files under model_repository/ are thin shims that hand
Triton's tensors to `python_backends.serving`, the only package that imports
`triton_python_backend_utils`.
"""
