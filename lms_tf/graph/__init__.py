"""Layer 1: a light, immutable view of a traced TensorFlow graph.

Example:
    >>> from lms_tf.graph import build_ir, Phase
"""

from lms_tf.graph.ir import GraphIR, OpInfo, Phase, TensorInfo, build_ir, layer_of

__all__ = ["GraphIR", "OpInfo", "Phase", "TensorInfo", "build_ir", "layer_of"]
