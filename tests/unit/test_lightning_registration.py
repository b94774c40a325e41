"""hora.lightning registers strategy="horovod", and refuses Lightning 1.x's accelerator spelling."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed "
                    "(pip install 'hora[lightning]'): the Lightning registration tests are skipped")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

import hora.lightning  # noqa: E402
import hora.torch as hvd  # noqa: E402
from hora.lightning import _strategy  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_importing_hora_lightning_registers_the_horovod_strategy():
    assert StrategyRegistry["horovod"]["strategy"] is hora.lightning.HorovodStrategy
    hora.lightning.register()  # again: harmless
    assert "horovod" in StrategyRegistry.available_strategies()


def test_the_lightning_1_accelerator_spelling_names_the_new_one():
    with pytest.raises(ValueError) as caught:
        pl.Trainer(accelerator="horovod", logger=False)
    message = str(caught.value)
    assert "Trainer(strategy='horovod')" in message
    assert "horarun -np N" in message
    assert not hvd.is_initialized()  # refused before any strategy was made


@pytest.mark.parametrize("given,expected", [
    (None, hvd.Average), ("mean", hvd.Average), ("avg", hvd.Average), ("SUM", hvd.Sum),
    ("max", hvd.Max), ("min", hvd.Min), ("product", hvd.Product),
    (torch.distributed.ReduceOp.SUM, hvd.Sum), (torch.distributed.ReduceOp.MAX, hvd.Max),
])
def test_lightning_reduce_ops_map_to_hora_ops(given, expected):
    assert _strategy._reduce_op(given) == expected


def test_an_unknown_reduce_op_is_refused_by_name():
    with pytest.raises(ValueError, match="'median'"):
        _strategy._reduce_op("median")
