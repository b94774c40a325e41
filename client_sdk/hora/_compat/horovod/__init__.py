"""hora's stand-in for Horovod: ``import horovod.torch as hvd`` runs on hora.

Put on ``PYTHONPATH`` by ``horovodrun`` / ``horarun --horovod-compat`` only.
"""

__version__ = "0.28.1+hora"
