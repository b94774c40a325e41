"""A stand-in for the real ``hora_coordinator``, for the launcher tests only.

Put its parent folder first on ``PYTHONPATH`` to test how ``horarun`` embeds
a coordinator (the startup line, the address given to workers, stopping it
at exit) independently of the real coordinator.
"""
