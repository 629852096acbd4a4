"""The model of TensorFlow's BFC allocator: known answers, and byte-exact agreement with the
real allocator on the same sequence of allocations (tests/bfc_sequence_worker.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from lms_tf.core.errors import LMSError
from lms_tf.simulate import BFCAllocatorModel, simulate, tensorflow_cpu_allocator, tensorflow_gpu_allocator
from lms_tf.simulate.allocator import CPU_MEMORY_LIMIT_BYTES, bin_index, replay_allocations, rounded_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def model_in_use(events, model):
    in_use = []
    for event, key, nbytes in events:
        model.allocate(key, nbytes) if event == "alloc" else model.free(key)
        in_use.append(model.in_use_bytes)
    return in_use


def real_in_use(events):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "bfc_sequence_worker.py"), json.dumps(events)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)  # noqa: E741
    assert line is not None, out.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def random_events(seed: int, count: int, mib_sizes=(3, 7, 20, 48, 100, 130), jitter=(0, 1000)):
    """Allocations of a MiB size from ``mib_sizes`` plus 4 x a number in ``jitter``'s range,
    and frees of random live ones."""
    rng = random.Random(seed)
    live, events = [], []
    for i in range(count):
        if live and rng.random() < 0.45:
            events.append(("free", live.pop(rng.randrange(len(live))), 0))
        else:
            key = f"t{i}"
            events.append(("alloc", key, rng.choice(mib_sizes) * MiB + 4 * rng.randrange(*jitter)))
            live.append(key)
    return events


@pytest.mark.timeout(300)
def test_model_matches_the_real_cpu_allocator_byte_for_byte():
    """Best fit, the split rule, merging of freed neighbours and region growth, against TF."""
    hand_made = [("alloc", "a", 100 * MiB), ("alloc", "b", 60 * MiB), ("free", "a", 0), ("alloc", "c", 60 * MiB),
                 ("alloc", "d", 30 * MiB), ("free", "b", 0), ("free", "c", 0), ("alloc", "e", 150 * MiB),
                 ("free", "d", 0), ("alloc", "f", 5 * MiB)]
    for events in (hand_made, random_events(0, 60), random_events(1, 60)):
        expected = real_in_use(events)
        model = tensorflow_cpu_allocator()
        model.allocate("tensorflow start-up", 256)  # TF's own first bytes open the first 2 MiB region
        got = [n - 256 for n in model_in_use(events, model)]
        assert got == expected, [(e, g, x) for e, g, x in zip(events, got, expected) if g != x][:3]
    # The sequence really exercises internal fragmentation: chunks bigger than what was asked.
    model = tensorflow_cpu_allocator()
    model_in_use(hand_made[:4], model)
    assert model.in_use_bytes > model.requested_bytes + 4 * MiB


@pytest.mark.timeout(300)
def test_equal_free_chunks_go_to_the_newest_region_as_in_tensorflow():
    """The CPU allocator's regions are mmap-ed top-down: of two equal free chunks, the newer
    region's has the lower address and is served first. Ranking regions the other way round
    gives other bytes in use on the same sequences. The requests are a little over a few MiB
    multiples: their chunks round to equal sizes, so best fit often chooses between equal chunks."""
    for seed in (0, 2):
        events = random_events(seed, 120, mib_sizes=(1, 2, 3, 5, 8), jitter=(1, 64))
        expected = real_in_use(events)
        got = {}
        for below in (True, False):
            model = BFCAllocatorModel(memory_limit_bytes=CPU_MEMORY_LIMIT_BYTES, allow_growth=True,
                                      new_regions_below=below)
            model.allocate("tensorflow start-up", 256)
            got[below] = [n - 256 for n in model_in_use(events, model)]
        assert got[True] == expected, [(e, g, x) for e, g, x in zip(events, got[True], expected) if g != x][:3]
        assert got[False] != expected


def test_rounding_and_bins():
    assert [rounded_bytes(n) for n in (1, 256, 257, 1000)] == [256, 256, 512, 1024]
    assert [bin_index(n) for n in (256, 511, 512, 1 << 20, 1 << 40)] == [0, 0, 1, 12, 20]


def test_split_rule_and_merging():
    bfc = tensorflow_gpu_allocator(1 << 30)  # one region: the whole memory
    bfc.allocate("a", 100 * MiB)
    bfc.allocate("b", 10 * MiB)
    bfc.free("a")
    bfc.allocate("c", 51 * MiB)  # 100 < 2 x 51: served whole
    assert bfc.in_use_bytes == 110 * MiB
    bfc.free("c")
    bfc.allocate("d", 49 * MiB)  # 100 >= 2 x 49: split
    assert bfc.in_use_bytes == 59 * MiB
    bfc.free("d")
    bfc.free("b")  # everything merges back into one free 1 GiB chunk...
    bfc.allocate("e", 900 * MiB)
    assert bfc.in_use_bytes == 1 << 30  # ...served whole: 124 MiB spare, under 2x and under 128 MiB
    big = tensorflow_gpu_allocator(4 << 30)
    big.allocate("a", 1000 * MiB)
    big.allocate("b", 1 * MiB)
    big.free("a")
    big.allocate("c", 800 * MiB)  # 1000 < 2 x 800, but 200 MiB spare >= 128 MiB: split
    assert big.in_use_bytes == 801 * MiB


def test_growth_regions_and_errors():
    bfc = tensorflow_cpu_allocator()
    bfc.allocate("a", 1 * MiB)
    assert bfc.pool_bytes == 2 * MiB
    bfc.allocate("b", 3 * MiB)  # a new 4 MiB region, served whole (4 < 2 x 3)
    assert bfc.pool_bytes == 6 * MiB and bfc.in_use_bytes == 5 * MiB
    with pytest.raises(LMSError, match="allocated twice"):
        bfc.allocate("a", 1)
    small = BFCAllocatorModel(memory_limit_bytes=8 * MiB)
    small.allocate("x", 6 * MiB)
    with pytest.raises(LMSError, match="does not fit.*memory_limit_bytes"):
        small.allocate("y", 3 * MiB)


def test_replay_measures_the_step_after_a_warm_up():
    log = [("alloc", "x", 3 * MiB), ("alloc", "y", 1 * MiB), ("free", "x", 0), ("rename", "y", "z"), ("free", "z", 0)]
    model = tensorflow_cpu_allocator()
    assert replay_allocations(log, model, resident=[("w", 5 * MiB)]) == 4 * MiB
    assert model.keys() == ["w"]


def test_simulated_step_through_the_allocator_model():
    """A step whose freed activation is too small for a later gradient but large enough to be
    reused unsplit: the allocator peak exceeds the summed peak by that chunk's spare bytes."""
    import tensorflow as tf

    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.tf.trace import build_ir

    @tf.function
    def step(x):
        a = tf.nn.relu(x * 2.0)                     # 4 MiB
        s = tf.reduce_sum(a)
        b = tf.tile(x[:, :160], [1, 1])             # 2.5 MiB, allocated after a is freed
        return s + tf.reduce_sum(b)

    ir = build_ir(step.get_concrete_function(tf.ones((4096, 256))).graph)
    sim = simulate(ir, cost=CostModel(get_device_spec("v100-16gb-pcie3")), allocator=tensorflow_cpu_allocator(),
                   log_allocations=True)
    assert sim.allocations and sim.allocations[0][0] == "alloc"
    assert sim.allocator_peak_bytes >= sim.peak_bytes
