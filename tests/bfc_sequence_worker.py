"""Runs a sequence of allocations and frees on TensorFlow's real CPU BFC allocator.

Reads ``[["alloc", key, bytes] | ["free", key, 0], ...]`` as JSON from argv[1]; each
allocation is an eager float32 tensor of that many bytes (a multiple of 4). Prints
``RESULT <json>``: the allocator's bytes in use after each event, relative to the start.
Run it in its own process: TensorFlow must start with a fresh BFC CPU allocator.
"""

import json
import os
import sys

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402


def main(events):
    live = {}
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    in_use = []
    for event, key, nbytes in events:
        if event == "alloc":
            live[key] = tf.zeros((nbytes // 4,), tf.float32)
        else:
            del live[key]
        in_use.append(tf.config.experimental.get_memory_info("CPU:0")["current"] - start)
    print("RESULT " + json.dumps(in_use))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
