"""hora.lightning: PyTorch Lightning 2.x on hora, as Horovod's strategy was in Lightning 1.x.

Importing this package registers the strategy under the name ``"horovod"``::

    import lightning.pytorch as pl
    import hora.lightning  # noqa: F401 - registers strategy="horovod"

    trainer = pl.Trainer(strategy="horovod", max_epochs=5)
    trainer.fit(model, datamodule)

and the script is started like any Horovod script, ``horarun -np 4 python
train.py`` (or ``horovodrun``). ``Trainer(strategy=HorovodStrategy())`` is
the same with the options spelled out. The Lightning 1.x spelling
``Trainer(accelerator="horovod")`` is refused with an error that names the
new one.

Needs ``pip install 'hora[lightning]'`` (Lightning >= 2.5).
"""

from __future__ import annotations

try:
    import lightning.pytorch  # noqa: F401 - fails here, with the hint below, when absent
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "hora.lightning needs PyTorch Lightning 2: pip install 'hora[lightning]' "
        f"(importing lightning.pytorch failed: {exc})") from exc

from ._strategy import HorovodStrategy, register

__all__ = ["HorovodStrategy", "register"]

register()
