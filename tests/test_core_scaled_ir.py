"""ScaledIR: a decoder's step IR at any width from a few small traces (for ``lms-tf max-params``)."""

import keras
import pytest
import tensorflow as tf

from lms_tf.core.ir import ScaledIR
from lms_tf.tf.trace import build_ir
from lms_tf.tf.workloads import train_step


def _decoder(width, depth=2, vocab=256, length=32):
    """Decoder blocks with 64-wide heads (so the head count grows with the width)."""
    keras.backend.clear_session()  # the same layer names at every width
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, width)(tokens)
    for _ in range(depth):
        a = keras.layers.MultiHeadAttention(width // 64, 64)(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(h + a)
        m = keras.layers.Dense(4 * width, activation="gelu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(m))
    return keras.Model(tokens, keras.layers.Dense(vocab)(h))


def _ir(width):
    spec = (tf.TensorSpec((4, 32), tf.int32), tf.TensorSpec((4, 32), tf.int32))
    return build_ir(tf.function(train_step(_decoder(width))).get_concrete_function(*spec).graph)


@pytest.mark.timeout(300)
def test_a_decoder_sized_by_arithmetic_at_a_width_never_traced_equals_its_trace():
    sized = ScaledIR.fit({width: _ir(width) for width in (128, 192, 256, 320)})
    assert sized is not None
    traced = _ir(512)
    assert sized.at(512).tensors == traced.tensors and sized.at(512).resolved_dims == traced.resolved_dims
