"""ScaledIR: a decoder's step IR at any width from a few small traces (what ``lms-tf max-params`` sizes)."""

import pytest

from lms_tf.cli.max_params import HEAD_SIZE, SAMPLE_WIDTHS
from lms_tf.cli.workload import trace_decoder_widths
from lms_tf.core.ir import ScaledIR

SHAPE = dict(depth=2, seq_len=32, batch=4, vocab=256, head_size=HEAD_SIZE)


@pytest.mark.timeout(300)
def test_a_decoder_sized_by_arithmetic_at_a_width_never_traced_equals_its_trace():
    """Fitted on the command's four sample widths, the sizes at 512 (8 heads) equal a real trace
    at 512, tensor for tensor (shape and bytes) and every resolved dimension."""
    sized = ScaledIR.fit(trace_decoder_widths(SAMPLE_WIDTHS, **SHAPE))
    assert sized is not None
    traced = trace_decoder_widths((512,), **SHAPE)[512]
    assert sized.at(512).tensors == traced.tensors and sized.at(512).resolved_dims == traced.resolved_dims
    assert [op.name for op in sized.at(512).ops] == [op.name for op in traced.ops]


@pytest.mark.timeout(300)
def test_a_size_that_is_not_a_polynomial_of_the_width_is_refused():
    """One head traces to a different graph from two to five heads: the fit refuses rather than
    give sizes that are wrong at every other width."""
    irs = trace_decoder_widths((64, 128, 192, 256), **SHAPE)
    assert ScaledIR.fit(irs) is None


def test_sized_irs_refuse_xla_temporaries_that_change_with_the_size():
    """XLA's temporaries of a compiled call (``GraphIR.compiled_scratch``) are not tensor sizes: a
    sized IR keeps the first sample's, so it is built only when every sample has the same."""
    import dataclasses

    from lms_tf.core import make_ir
    from lms_tf.core.ir import BatchSizedIR, ScaledIR

    def ir(n, scratch):
        plain = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (n, 4))]),
                         dict(name="call", type="PartitionedCall", inputs=["x:0"], outputs=[("call:0", (n, 4))])])
        return dataclasses.replace(plain, compiled_scratch={"call": scratch}, compiled_for="CPU")

    same = BatchSizedIR.fit({2: ir(2, 100), 3: ir(3, 100), 5: ir(5, 100)})
    assert same is not None and same.at(64).compiled_scratch == {"call": 100}
    assert BatchSizedIR.fit({2: ir(2, 100), 3: ir(3, 150), 5: ir(5, 250)}) is None
    assert ScaledIR.fit({1: ir(1, 7), 2: ir(2, 7), 3: ir(3, 7), 4: ir(4, 7)}) is not None
    assert ScaledIR.fit({1: ir(1, 7), 2: ir(2, 8), 3: ir(3, 9), 4: ir(4, 10)}) is None
