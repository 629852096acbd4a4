"""Every use of a private TensorFlow or Keras API in lms-tf lives in this package, by subject.

- :mod:`~lms_tf._compat.graph`: editing a graph while it is traced, op attributes, shape inference;
- :mod:`~lms_tf._compat.data`: the batch size of a ``tf.data`` pipeline;
- :mod:`~lms_tf._compat.keras`: Keras internals (XLA flag, name scopes, fit's batch size, the
  optimizer classes whose update methods receive the gradients);
- :mod:`~lms_tf._compat.grappler`: Grappler's virtual cluster (the GPU memory oracle);
- :mod:`~lms_tf._compat.profiler`: TensorFlow's profiler trace (executed ops, allocations);
- :mod:`~lms_tf._compat.xla`: XLA's buffer plan of a function the step calls compiled.

A TensorFlow or Keras release that changes one of these breaks here, loudly, and is tested in
``tests/test_tf_compat.py``. The names are re-exported, so callers write ``_compat.string_attr``.

Examples:
    >>> from lms_tf import _compat
    >>> _compat.check_private_apis()  # raises LMSError if this TF lacks an API we need
"""

from lms_tf._compat.data import dataset_batch_size
from lms_tf._compat.graph import (
                                  add_control_input,
                                  automatic_control_dependencies,
                                  automatic_control_edges,
                                  check_private_apis,
                                  clone_op,
                                  control_outputs,
                                  current_graph,
                                  function_body_graph_def,
                                  function_def,
                                  infer_shapes_with_inputs,
                                  is_dead_end,
                                  is_function_graph,
                                  move_variable_in_place,
                                  op_is_stateful,
                                  place_with_inputs,
                                  remove_control_input,
                                  set_bool_attr,
                                  set_int_attr,
                                  set_string_attr,
                                  string_attr,
                                  traced_variables,
                                  set_device, update_input,
)
from lms_tf._compat.grappler import (
                                  GRAPPLER_RECOMPUTED_PREFIX,
                                  GRAPPLER_SWAP_OPS,
                                  grappler_accumulated_sums,
                                  grappler_default_optimized,
                                  grappler_memory_optimized,
                                  grappler_peak_live_tensors,
                                  grappler_peak_memory,
)
from lms_tf._compat.keras import (
                                  call_node,
                                  fit_batch_size,
                                  flat_model_inputs,
                                  functional_graph,
                                  get_jit_compile,
                                  keras_module,
                                  layer_scope_aliases,
                                  layer_scope_aliases_in,
                                  move_variables,
                                  nested_layers,
                                  nodes_in_call_order,
                                  optimizer_entry_points,
                                  rekey_optimizer,
                                  run_again_without_updates,
                                  set_jit_compile,
                                  using_legacy_keras,
)
from lms_tf._compat.profiler import onednn_enabled, profile_allocations, profile_executed_ops
from lms_tf._compat.xla import compiled_temp_bytes, must_compile

__all__ = ["GRAPPLER_RECOMPUTED_PREFIX", "GRAPPLER_SWAP_OPS", "add_control_input", "automatic_control_dependencies", "automatic_control_edges", "control_outputs", "remove_control_input",
           "call_node", "compiled_temp_bytes", "check_private_apis", "clone_op", "current_graph", "dataset_batch_size", "fit_batch_size",
           "flat_model_inputs", "function_body_graph_def", "function_def", "nested_layers", "functional_graph", "get_jit_compile", "grappler_accumulated_sums",
           "grappler_default_optimized", "grappler_memory_optimized", "grappler_peak_live_tensors",
           "grappler_peak_memory", "infer_shapes_with_inputs", "is_dead_end", "is_function_graph", "keras_module",
           "layer_scope_aliases", "layer_scope_aliases_in", "move_variables", "must_compile", "nodes_in_call_order", "onednn_enabled",
           "op_is_stateful", "optimizer_entry_points", "place_with_inputs", "profile_allocations", "profile_executed_ops", "rekey_optimizer", "run_again_without_updates",
           "set_bool_attr", "set_device", "set_int_attr", "set_jit_compile", "set_string_attr", "string_attr", "update_input",
           "using_legacy_keras"]
