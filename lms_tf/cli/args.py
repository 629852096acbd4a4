"""Arguments shared by the subcommands: one flag name, one parser and one check for each thing.

Every value is checked while the command line is parsed, before any model is built: a bad value
exits with code 2 and a message naming the rule it broke.

Examples:
    >>> budget("25%"), size("12GiB"), input_size("224x224")
    (0.25, 12884901888, 224)
"""

from __future__ import annotations

import argparse

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.policy import parse_budget, parse_bytes
from lms_tf.cost.devices import PRESETS, get_device_spec


def budget(text: str):
    """``--budget``: bytes, ``12GiB``, ``25%`` of the plain peak, or ``auto`` (:func:`lms_tf.core.policy.parse_budget`).

    Examples:
        >>> budget("auto")
        'auto'
    """
    try:
        return parse_budget(text)
    except LMSOptionError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def size(text: str) -> int:
    """A positive byte size: ``1024``, ``500MB``, ``12GiB``.

    Examples:
        >>> size("1KiB")
        1024
    """
    nbytes = parse_bytes(text)
    if nbytes is None:
        raise argparse.ArgumentTypeError(f"must be a positive size such as 1024, 500MB or 12GiB; received {text!r}")
    return nbytes


def positive_int(text: str) -> int:
    """An int >= 1 (``--batch``, ``--classes``, ``--max``).

    Examples:
        >>> positive_int("8")
        8
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1; received {text!r}")
    return value


def input_size(text: str) -> int:
    """``--input-shape``: ``HxW`` with H == W (images) or a sequence length; the size models are built with.

    Examples:
        >>> input_size("96"), input_size("32x32")
        (96, 32)
    """
    parts = text.lower().replace(",", "x").split("x")
    try:
        sizes = [int(p) for p in parts if p]
    except ValueError:
        sizes = []
    if not sizes or len(set(sizes[:2])) != 1 or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"must be HxW with H == W (e.g. 224x224) or a sequence length; "
                                         f"received {text!r}")
    return sizes[0]


def device_preset(text: str) -> str:
    """``--device``: the device the planner and Grappler's virtual GPU model, a preset name or ``auto``.

    Examples:
        >>> device_preset("V100-16GB-PCIE3")
        'v100-16gb-pcie3'
    """
    if text.lower() == "auto":
        return "auto"
    try:
        return get_device_spec(text.lower()).name
    except LMSOptionError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_model_arguments(parser: argparse.ArgumentParser, *, batch: bool = True) -> None:
    """``--model``, ``--input-shape``, ``--classes`` (and ``--batch``): the workload, the same in every subcommand.

    Examples:
        >>> p = argparse.ArgumentParser(); add_model_arguments(p)
        >>> p.parse_args(["--model", "resnet50", "--batch", "8"]).input_shape
        224
    """
    parser.add_argument("--model", required=True, help="keras.applications name (any case, e.g. resnet50), UNet, "
                                                      "TransformerEncoder, StackedRNN, a .keras file or module:factory")
    parser.add_argument("--input-shape", type=input_size, default=224, metavar="HxW",
                        help="input size of keras.applications / built-in models, e.g. 224x224 (sequence length "
                             "for TransformerEncoder and StackedRNN); default 224")
    parser.add_argument("--classes", type=positive_int, default=1000)
    if batch:
        parser.add_argument("--batch", type=positive_int, required=True, help="batch size of the traced step")


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    """``--weights``: where the variables live, as ``weights=`` of ``LMSCallback`` and ``lms_tf.function``.

    Examples:
        >>> p = argparse.ArgumentParser(); add_weights_argument(p)
        >>> p.parse_args([]).weights, p.parse_args(["--weights", "host"]).weights
        ('device', 'host')
    """
    parser.add_argument("--weights", choices=("device", "host", "auto"), default="device",
                        help="device: variables resident (default); host: each is fetched per window of its "
                             "readers, as weights='host' does; auto: the planner puts on the host only the "
                             "weights the budget needs there (the budget then counts the resident variables)")


def add_host_budget_argument(parser: argparse.ArgumentParser) -> None:
    """``--host-budget``: host memory one process may hold, as ``host_budget=`` of the front-ends.

    Examples:
        >>> p = argparse.ArgumentParser(); add_host_budget_argument(p)
        >>> p.parse_args([]).host_budget, p.parse_args(["--host-budget", "1KiB"]).host_budget
        (None, 1024)
    """
    parser.add_argument("--host-budget", type=size, default=None,
                        help="host memory one process's planned step may hold (weights and slots on the host, "
                             "swapped tensors, gradients copied out); default: this machine's physical memory")


def add_logical_cpus_argument(parser: argparse.ArgumentParser) -> None:
    """``--logical-cpus``: CPU devices each pipeline stage process has (``lms-tf launch`` and
    ``lms-tf stage-server``).

    Examples:
        >>> p = argparse.ArgumentParser(); add_logical_cpus_argument(p)
        >>> p.parse_args([]).logical_cpus, p.parse_args(["--logical-cpus", "2"]).logical_cpus
        (1, 2)
    """
    parser.add_argument("--logical-cpus", type=positive_int, default=1,
                        help="CPU devices each stage process has (CPU:0 to CPU:N-1, one allocator): with 2, a stage "
                             "on CPU:0 can swap to host='/CPU:1' on a machine without GPUs (default: 1)")


def add_memory_trace_argument(parser: argparse.ArgumentParser) -> None:
    """``--memory-trace DIR``: each pipeline stage server records its allocator's requests over
    its life and writes them to ``DIR/stage<k>.json`` when it stops (``lms-tf launch`` and
    ``lms-tf stage-server``).

    Examples:
        >>> p = argparse.ArgumentParser(); add_memory_trace_argument(p)
        >>> p.parse_args([]).memory_trace, p.parse_args(["--memory-trace", "traces"]).memory_trace
        (None, 'traces')
    """
    parser.add_argument("--memory-trace", metavar="DIR",
                        help="record every request to each stage server's allocator over its life (TensorFlow's "
                             "profiler; on a CPU set TF_CPU_ALLOCATOR_USE_BFC=true), write them to DIR/stage<k>.json "
                             "when it stops and log the largest buffers live at its peak; a path on each stage's "
                             "own host")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device``: the device preset planned for (and the virtual GPU's memory).

    Examples:
        >>> p = argparse.ArgumentParser(); add_device_argument(p)
        >>> p.parse_args([]).device
        'v100-16gb-pcie3'
    """
    parser.add_argument("--device", type=device_preset, default="v100-16gb-pcie3",
                        help=f"device preset ({', '.join(PRESETS)}) or auto (the visible GPU)")


def add_output_arguments(parser: argparse.ArgumentParser, max_rows: int) -> None:
    """``--json``, ``--max-rows`` and ``--wide``.

    Examples:
        >>> p = argparse.ArgumentParser(); add_output_arguments(p, 30)
        >>> p.parse_args(["--json"]).json, p.parse_args(["--wide"]).wide
        (True, True)
    """
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--max-rows", type=positive_int, default=max_rows, help="rows of the plan table")
    parser.add_argument("--wide", action="store_true",
                        help="print layer and tensor names whole (by default long ones are cut in the middle)")
