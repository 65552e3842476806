"""Compiler passes over the tensor-level backward graph (paper section 5)."""
