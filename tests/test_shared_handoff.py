"""The slots of the pipeline's hand-offs through shared memory (mpcomm.parallel.shared_handoff.slot_plan): a slot
takes a new message only once the receiver is done with its last one, whatever the timing — checked against
simulated runs of every schedule with random compute times and latencies."""
import numpy as np
import pytest

from mpcomm.parallel.schedules import B, F, schedule, simulate_timeline, with_communication
from mpcomm.parallel.shared_handoff import slot_plan

CASES = [("gpipe", 2, 4, 1), ("1f1b", 2, 8, 1), ("1f1b", 3, 5, 1), ("1f1b", 4, 8, 1), ("gpipe", 4, 3, 1),
         ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 2, 8, 2), ("interleaved-1f1b", 4, 8, 2),
         ("interleaved-1f1b", 3, 6, 3)]


def _slots_by_link(lists, plan):
    """(sender, receiver, slot) -> match keys of its messages, in the sender's order."""
    out = {}
    for r, acts in enumerate(lists):
        for a in acts:
            if a.is_send:
                out.setdefault((r, a.peer, plan[a.match_key()]), []).append(a.match_key())
    return out


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_a_slot_takes_a_message_only_after_the_receiver_used_the_one_before(name, pp, m, v):
    lists = with_communication(schedule(name, pp, m, v), pp, v)
    by_slot = _slots_by_link(lists, slot_plan(lists))
    rng = np.random.default_rng(0)
    for trial in range(40):
        durations, latencies = {}, {}

        def compute(a):
            return durations.setdefault((a.kind, a.stage, a.microbatch), rng.uniform(0.1, 3.0))

        def latency(a):
            return latencies.setdefault(a.match_key(), 0.0 if trial == 0 else rng.exponential(1.0))

        timeline = simulate_timeline(lists, compute, compute, latency)
        end = {(a.kind, a.stage, a.microbatch): e for events in timeline.events for _, e, a in events}
        for keys in by_slot.values():
            for used, taken in zip(keys, keys[1:]):
                direction, stage, mb = used
                consumer = (B, stage + 1 if direction == F else stage - 1, mb)  # its receiver's backward
                written = end[taken]  # the sender copies a message right after computing it
                assert end[consumer] <= written, (name, trial, used, taken)


def test_one_f_one_b_needs_a_slot_per_micro_batch_in_flight_and_gpipe_one_per_micro_batch():
    for name, expected in (("1f1b", 2), ("gpipe", 8)):
        lists = with_communication(schedule(name, 2, 8), 2, 1)
        slots = list(_slots_by_link(lists, slot_plan(lists)))
        assert sorted({(r, p) for r, p, _ in slots}) == [(0, 1), (1, 0)]
        for link in ((0, 1), (1, 0)):
            assert len([s for s in slots if s[:2] == link]) == expected, name
