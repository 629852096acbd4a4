"""Hybrid parallelism (SplitBrain): memory-heavy layers sharded across Horovod ranks, the rest
data-parallel.

- :class:`ShardedDense`: a ``Dense`` layer whose kernel is split across ranks, by output columns
  or by input rows; :class:`ShardedEmbedding`: an ``Embedding`` whose table is split by token id.
- :func:`plan_hybrid` / :func:`hybridize` / :func:`unshard` / :func:`save_unsharded`: which layers
  of a model to shard (a table you can read and override), the sharded copy of the model, and the
  ordinary model back (to evaluate or save).

Train the hybrid model as a data-parallel one (``DistributedCallback`` or
``lms_tf.function(horovod=True)``): the replicated layers' gradients are averaged across ranks and
the shards' are left alone.

Examples:
    >>> import keras
    >>> from lms_tf import parallel
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc")])
    >>> parallel.hybridize(model, min_param_bytes=0, group_size=1).hybrid_plan.sharded_layers
    ('fc',)
"""

from lms_tf.parallel.hybrid import (HybridPlan, LayerChoice, hybridize, plan_hybrid, save_unsharded, unshard,
                                    whole_weights)
from lms_tf.parallel.sharded import ShardedDense, ShardedEmbedding

__all__ = ["HybridPlan", "LayerChoice", "ShardedDense", "ShardedEmbedding", "hybridize", "plan_hybrid",
           "save_unsharded", "unshard", "whole_weights"]
