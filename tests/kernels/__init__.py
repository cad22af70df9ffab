"""Kernel tests."""
