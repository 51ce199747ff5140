"""Argument parsing per op, shared by ``fastattn`` and ``fastattn.reference`` so both reject the same inputs
with the same messages. NumPy only: importing this never loads Numba."""
