"""Bounds checking of interpreted Triton kernels: every load and store against its launch's tensors.

``checker`` holds the modes, the checker and its report; ``_hooks`` patches the interpreter.
"""
