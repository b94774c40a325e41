"""How elastic state agrees on host changes (framework-neutral, hora.elastic)."""

from __future__ import annotations

import pytest

from hora.elastic import ObjectState
from hora.errors import HostsUpdatedInterrupt

pytestmark = pytest.mark.unit


def make(seen: list[tuple[int, bool]], agreed: list[tuple[int, bool]]) -> ObjectState:
    """A state whose coordinator view and whose agreement answer the test sets."""
    return ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0,
                       host_update_epoch=lambda: seen[-1],
                       agree_host_update=lambda mine: (seen.append(mine), agreed[-1])[1],
                       epoch=0, batch=5)


def test_the_agreement_is_not_mistaken_for_a_state_attribute():
    state = make([(0, False)], [(0, False)])
    state.commit()
    assert state._saved_state == {"epoch": 0, "batch": 5}
    assert not hasattr(state, "agree_host_update")


def test_a_newer_agreed_epoch_interrupts_once_with_its_skip_sync():
    seen, agreed = [(0, False)], [(0, False)]
    state = make(seen, agreed)
    state.sync_host_updates()
    state.commit()  # nothing new
    agreed.append((2, True))  # another rank saw a removal
    with pytest.raises(HostsUpdatedInterrupt) as exc:
        state.commit()
    assert exc.value.skip_sync is True
    state.commit()  # epoch 2 was handled: no second interrupt
    agreed.append((3, False))
    with pytest.raises(HostsUpdatedInterrupt) as exc:
        state.commit()
    assert exc.value.skip_sync is False


def test_a_newcomer_that_came_before_the_first_heartbeat_still_interrupts():
    # The generation formed at epoch 1; a newcomer raised the job's epoch to 2 before
    # this worker's first heartbeat, which already reports 2.
    seen = [(2, False)]
    state = ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0,
                        host_update_epoch=lambda: seen[-1],
                        agree_host_update=lambda mine: mine,
                        generation_host_epoch=lambda: 1, epoch=0)
    state.sync_host_updates()
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    state.commit()  # handled once


def test_without_a_generation_epoch_the_sync_adopts_the_newest_seen():
    seen = [(2, False)]
    state = make(seen, [(2, False)])
    state.sync_host_updates()
    state.commit()
