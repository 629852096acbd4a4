"""``DistributedCallback``: data-parallel ``model.fit`` across Horovod ranks, on the distributed core.

Examples:
    >>> from lms_tf.keras.distributed import DistributedCallback
"""

from __future__ import annotations

from typing import Dict, List, Optional

from lms_tf import _compat
from lms_tf.core.errors import LMSError, LMSOptionError
from lms_tf.core.policy import check_bucket_bytes
from lms_tf.horovod import (
    ALLREDUCE_ORDER,
    DEFAULT_BUCKET_BYTES,
    average_logs,
    broadcast_variables,
    gradient_allreduce_hook,
    horovod_tensorflow,
)
from lms_tf.keras.step_hooks import add_step_hook, check_traceable, detach, turn_jit_off
from lms_tf.tf.optimizer_hooks import intercept_optimizer_updates

_API = "DistributedCallback"


class DistributedCallback(_compat.keras_module().callbacks.Callback):
    """Keras callback for data-parallel ``model.fit`` across Horovod ranks (Keras 3 and tf-keras).

    Put it in ``callbacks`` of every rank, beside :class:`lms_tf.LMSCallback` if wanted (either
    order), give each rank its own shard of the data, and launch with ``horovodrun``.

    * ``on_train_begin``: broadcasts the model's variables (and the optimizer's, if it was
      already built, e.g. resumed training) from ``root_rank``. An optimizer that is not
      built yet needs no broadcast: it is built identically on every rank in the first
      step, which applies the same averaged gradients to the same weights.
    * In the traced train step: averages the gradients across ranks between
      ``tape.gradient`` and the optimizer update, pipelined in buckets of
      ``bucket_bytes`` (see :func:`lms_tf.horovod.allreduce_gradients`).
    * ``on_epoch_end``: averages the numeric logs (loss, metrics, val_*) across ranks, in
      place, so ``History`` and later callbacks see the global values. The per-rank values
      are kept in :attr:`local_logs`.

    Not averaged (as in Horovod): BatchNormalization's moving statistics, which each rank
    computes from its own batch.

    Args:
        root_rank: The rank whose initial variables every rank starts from.
        bucket_bytes: Bytes per gradient bucket (pipelined exchange); None for one
            allreduce after the whole backward pass.
        average_metrics: Whether to average the logs at epoch end.

    Attributes:
        local_logs: The logs of each epoch on this rank, before averaging.
        broadcast_count: Variables broadcast when training began.

    Raises:
        LMSError: Horovod is not installed or not usable.
        LMSOptionError: Invalid arguments, or the model runs eagerly.

    Examples:
        >>> import numpy as np, keras
        >>> from lms_tf.keras import DistributedCallback
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile("sgd", "mse")
        >>> callback = DistributedCallback()
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 2)), epochs=1, verbose=0, callbacks=[callback])
        >>> callback.broadcast_count
        2
    """

    def __init__(self, root_rank: int = 0, bucket_bytes: Optional[int] = DEFAULT_BUCKET_BYTES,
                 average_metrics: bool = True):
        super().__init__()
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank < 0:
            raise LMSOptionError(f"{_API}: root_rank must be an int >= 0; received {root_rank!r}.")
        check_bucket_bytes(bucket_bytes, _API)
        if not isinstance(average_metrics, bool):
            raise LMSOptionError(f"{_API}: average_metrics must be True or False; received {average_metrics!r}.")
        hvd = horovod_tensorflow()
        if root_rank >= hvd.size():
            raise LMSOptionError(f"{_API}: root_rank={root_rank} but the job has {hvd.size()} rank(s); "
                                 f"use a rank in 0..{hvd.size() - 1}.")
        self.root_rank = root_rank
        self.bucket_bytes = bucket_bytes
        self.average_metrics = average_metrics
        self.local_logs: List[Dict[str, object]] = []
        self.broadcast_count = 0
        self.updates_intercepted = [0]
        self._restore = None
        self._checked = False  # the no-update check runs after the first call of the train function

    def on_train_begin(self, logs=None):
        """Broadcasts the variables from the root rank and hooks the gradient averaging into the train step.

        Examples:
            >>> import keras
            >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            >>> model.compile("sgd", "mse")
            >>> callback = DistributedCallback()
            >>> callback.set_model(model); callback.on_train_begin()
            >>> callback.broadcast_count   # the Dense kernel and bias
            2
            >>> callback.on_train_end()
        """
        model = self.model
        check_traceable(model, _API)
        self._checked = False  # each fit traces its step again
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables += list(optimizer.variables)
        self.broadcast_count = broadcast_variables(variables, self.root_rank)
        jit_was = turn_jit_off(model, _API, "Horovod's allreduce ops have no XLA kernels in this build")
        allreduce_hook = gradient_allreduce_hook(self.bucket_bytes, self.updates_intercepted)

        def distributed_hook(step):
            def train_step(data):
                with intercept_optimizer_updates(allreduce_hook, order=ALLREDUCE_ORDER):
                    return step(data)
            return train_step

        self._restore = (distributed_hook, jit_was)
        add_step_hook(model, distributed_hook)

    def on_train_batch_end(self, batch, logs=None):
        """After the first call of the train function (``batch`` is its last step: ``steps_per_execution - 1``
        for the first), the traced step must have passed its gradients through a Keras optimizer.

        Examples:
            >>> DistributedCallback.on_train_batch_end.__name__
            'on_train_batch_end'
        """
        first_call, self._checked = not self._checked, True
        if first_call and self.updates_intercepted[0] == 0 and self._restore is not None:
            raise LMSError(
                f"{_API}: the train step of {self.model.name!r} updated no variables through a Keras optimizer "
                f"(optimizer.apply / apply_gradients), so there was nowhere to average the gradients and the ranks "
                f"would drift apart. Use a Keras optimizer in train_step, or average with hvd.allreduce yourself.")

    def on_epoch_end(self, epoch, logs=None):
        """Averages the epoch's numeric logs across ranks, in place (the local ones are kept in ``local_logs``).

        Examples:
            >>> callback = DistributedCallback()
            >>> logs = {"loss": 0.5}
            >>> callback.on_epoch_end(0, logs); logs, callback.local_logs   # one rank: the average is the value
            ({'loss': 0.5}, [{'loss': 0.5}])
        """
        if logs is None:
            return
        self.local_logs.append(dict(logs))
        if self.average_metrics:
            logs.update(average_logs(logs, name=f"lms_tf_metrics_epoch_{epoch}"))

    def on_train_end(self, logs=None):
        """Removes the averaging hook; the model's own train step is back.

        Examples:
            >>> import keras
            >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            >>> model.compile("sgd", "mse")
            >>> callback = DistributedCallback()
            >>> callback.set_model(model); callback.on_train_begin(); callback.on_train_end()
            >>> "train_step" in model.__dict__
            False
        """
        restore, self._restore = self._restore, None
        if restore is None:
            return
        detach(self.model, restore)
