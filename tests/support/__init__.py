"""Shared helpers for hora's tests (real processes, no mocks of our own components)."""
