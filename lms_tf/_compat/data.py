"""The batch size of a ``tf.data`` pipeline, read from its private Python structure.

``Dataset.batch(n)`` without ``drop_remainder`` gives elements whose batch dimension is
unknown (``None``), so a step traced on them cannot be sized. Each ``tf.data`` transformation
keeps its input in ``_input_dataset`` (``zip`` keeps ``_datasets``) and the batching ones keep
their size in ``_batch_size``: the last batching transformation sets the largest batch the
pipeline yields (the final, partial batch can only be smaller).

Examples:
    >>> import tensorflow as tf
    >>> dataset_batch_size(tf.data.Dataset.range(10).batch(4).prefetch(2))
    4
"""

from __future__ import annotations

from typing import Optional


def dataset_batch_size(dataset) -> Optional[int]:
    """The size of the last ``batch``/``padded_batch`` in ``dataset``'s pipeline, or None.

    Returns None when no batching transformation is found (a pipeline batched inside a
    ``flat_map`` or a generator, for example) or its size is not a constant.

    Examples:
        >>> import tensorflow as tf
        >>> images = tf.data.Dataset.from_tensor_slices(tf.zeros((10, 2)))
        >>> dataset_batch_size(tf.data.Dataset.zip((images, images)).batch(3).map(lambda a, b: a))
        3
        >>> dataset_batch_size(images) is None
        True
    """
    pending, seen = [dataset], set()
    while pending:
        node = pending.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        size = getattr(node, "_batch_size", None)
        if size is not None:
            try:
                value = int(size.numpy() if hasattr(size, "numpy") else size)
            except (TypeError, ValueError):
                return None
            return value if value > 0 else None
        if type(node).__name__ in ("_UnbatchDataset", "_RebatchDataset"):
            return None  # what follows is per-example or re-batched: the sizes before it do not hold
        pending.append(getattr(node, "_input_dataset", None))
        pending.extend(getattr(node, "_datasets", None) or ())
    return None
