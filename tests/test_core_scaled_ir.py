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
