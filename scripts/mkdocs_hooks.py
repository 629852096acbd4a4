"""MkDocs hooks for the documentation site (``mkdocs.yml``).

- The front page is the README, its links re-pointed from ``docs/x.md`` to ``x.md``.
- The troubleshooting page lists the library's own error and warning messages: each case below
  is run and the message it raises is written into the page, when the site builds and when this
  script runs (``python scripts/mkdocs_hooks.py`` rewrites the committed page; a test checks the
  committed page equals what the library says now).
"""

from __future__ import annotations

import os
import re
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cases():
    """(what the user did, a callable that does it) for each problem the page shows."""
    import tensorflow as tf

    import lms_tf
    from lms_tf.core import Plan, Policies, parse_budget
    from lms_tf.core.errors import UnknownSizeError, warn_once
    from lms_tf.core.examples import chain_ir
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.pipeline import PipelineProfile, partition_layers
    from lms_tf.planner import make_budget_plan
    from lms_tf.tf.driver import unknown_size_message

    # Two logical CPUs stand in for a device and its host, as in the examples. A process that
    # configured its own (the test suite's three, when a test builds the site in-process) keeps them.
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or []) < 2:
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        except RuntimeError:
            pass  # already initialised

    def infeasible():
        make_budget_plan(chain_ir(), Policies(host="/CPU:1", budget="1KiB"), device="/device:GPU:0",
                         cost=CostModel(get_device_spec("v100-16gb-pcie3")))

    def host_memory(host_budget="512KiB"):
        from lms_tf.core.examples import weighted_chain_ir

        make_budget_plan(weighted_chain_ir(), Policies(host="/CPU:1", budget="auto", weights="host",
                                                       host_budget=host_budget),
                         device="/device:GPU:0", cost=CostModel(get_device_spec("v100-16gb-pcie3")))

    def unassigned_layer():
        import keras

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="hidden"),
                                  keras.layers.Dense(2, name="head")], name="mlp")
        lms_tf.PipelineStep(model, [["hidden"]], devices=["/CPU:0"])

    def stage_without_host():
        import keras

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="hidden"),
                                  keras.layers.Dense(2, name="head")], name="mlp")
        lms_tf.PipelineStep(model, [["hidden"], ["head"]], swap=True, host="/CPU:1",
                            devices=["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"])

    def random_stage():
        import keras
        import numpy as np

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="hidden"),
                                  keras.layers.Dropout(0.5, name="dropout"), keras.layers.Dense(2, name="head")],
                                 name="mlp")
        step = lms_tf.PipelineStep(model, [["hidden", "dropout"], ["head"]], devices=["/CPU:0", "/CPU:1"],
                                   recompute=True)
        step(np.ones((2, 4), "float32"), np.zeros((2,), "int32"))

    def eager():
        tf.config.run_functions_eagerly(True)
        try:
            lms_tf.function(lambda x: x * 2.0, device="/CPU:0", host="/CPU:1")(tf.constant(1.0))
        finally:
            tf.config.run_functions_eagerly(False)

    def no_workers():
        saved = os.environ.pop("LMS_TF_WORKERS", None)
        try:
            lms_tf.connect_stages()
        finally:
            if saved is not None:
                os.environ["LMS_TF_WORKERS"] = saved

    return [
        ("A budget that no plan can fit", infeasible),
        ("A budget string lms-tf cannot read", lambda: parse_budget("12 gigs")),
        ("Weights on the host that alone are more than the process may use", lambda: host_memory("256KiB")),
        ("A plan that needs more host memory than the process may use", host_memory),
        ("An option out of range", lambda: lms_tf.LMSOptions(swapin_ahead=0)),
        ("An unknown device preset", lambda: get_device_spec("v200-16gb")),
        ("Horovod's bucket size without Horovod", lambda: lms_tf.function(lambda x: x, bucket_bytes=2**20)),
        ("A plan file that is not a plan", lambda: Plan.from_json('{"decisions": []}')),
        ("A pipeline budget no cut of the model meets", lambda: partition_layers(
            PipelineProfile.chain([2**20] * 4), stages=2, microbatches=4, budget="1MiB")),
        ("A swapping pipeline stage that needs more host memory than host_budget", lambda: partition_layers(
            PipelineProfile.chain([2**20] * 4), stages=2, microbatches=4, budget="2.5MiB", host_budget="256KiB")),
        ("More pipeline stages than layers", lambda: partition_layers(PipelineProfile.chain([2**20] * 4), stages=8,
                                                                       microbatches=4)),
        ("A pipeline cut that leaves a layer out", unassigned_layer),
        ("A pipeline stage process that is not running", lambda: lms_tf.connect_stages(
            "localhost:2222,localhost:1", timeout=1)),
        ("A pipeline script started without its stages' addresses", no_workers),
        ("A swapping stage whose process has no such host device", stage_without_host),
        ("A recomputing pipeline stage that draws random numbers (a warning: that stage keeps its activations)",
         random_stage),
        ("Asking for a plan before training", lambda: lms_tf.explain(lms_tf.LMSCallback())),
        ("A step that runs eagerly", eager),
        ("No GPU and no device given (a warning: the step trains untouched)",
         lambda: warn_once("docs-no-gpu", _no_gpu_message())),
        ("A batch size lms-tf cannot find (a warning: the step trains untouched)",
         lambda: warn_once("docs-unknown-size", unknown_size_message(
             "LMSCallback", UnknownSizeError("", tensor="dense/Relu:0", shape=(None, 64))))),
    ]


def _no_gpu_message() -> str:
    from lms_tf.tf.driver import no_accelerator_message

    return no_accelerator_message("LMSCallback")


def troubleshooting_markdown() -> str:
    """The cases' headings and the messages the library gives for them."""
    sections = []
    for title, case in _cases():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                case()
            except Exception as err:  # noqa: BLE001 - every case must end in the library's own error
                kind, message = type(err).__name__, str(err)
            else:
                if not caught:
                    raise RuntimeError(f"troubleshooting case {title!r} raised and warned nothing")
                kind, message = caught[-1].category.__name__, str(caught[-1].message)
        if kind not in ("LMSError", "LMSOptionError", "InfeasibleBudgetError", "HostBudgetError", "LMSWarning",
                        "RewriteError", "GraphAnalysisError"):
            raise RuntimeError(f"troubleshooting case {title!r} gave {kind}, not one of lms-tf's types: {message}")
        sections.append(f"## {title}\n\n```text\nlms_tf.{kind}: {message}\n```\n")
    return "\n".join(sections)


BEGIN, END = "<!-- errors: written by `python scripts/mkdocs_hooks.py` -->", "<!-- end of errors -->"
TROUBLESHOOTING = os.path.join(ROOT, "docs", "troubleshooting.md")


def with_messages(page_text: str) -> str:
    """``page_text`` with the block between the markers replaced by the current messages."""
    head, _, rest = page_text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{troubleshooting_markdown()}\n{END}{tail}"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fills the front page with the README, and the troubleshooting page with the messages the
    library gives now (the committed page holds the same block: a test keeps them equal)."""
    if page.file.src_uri == "index.md":
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        return re.sub(r"\]\(docs/", "](", readme)
    if BEGIN in markdown:
        return with_messages(markdown)
    return markdown


if __name__ == "__main__":
    with open(TROUBLESHOOTING, encoding="utf-8") as f:
        text = f.read()
    with open(TROUBLESHOOTING, "w", encoding="utf-8") as f:
        f.write(with_messages(text))
