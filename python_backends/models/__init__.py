"""Transformer definitions; they read like single-device code."""
