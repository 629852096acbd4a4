"""Benchmark: hybrid parallelism (SplitBrain, ``lms_tf.parallel``) against pure data parallelism, per rank.

Two models, at 1, 2 and 4 Horovod ranks (Gloo, this machine), side by side in one run:

- **VGG-16 at CIFAR-10 shape**: Keras's VGG-16 convolutions on 32x32x3 images, then Dense 4096,
  Dense 4096 and Dense 10 (33.6M parameters, 56% of them in the two wide Dense layers);
- **a text model with a large embedding and output projection**: Embedding 8,192 x 256 (2.1M
  parameters), Dense 512 (ReLU), and a Dense over a 32,768-token vocabulary at each of 32
  positions (the projection: 8.4M of 11.1M parameters).

Variants, each one ``horovodrun`` job (every rank its own process and allocator): ``dp`` (the model
replicated, gradients averaged), ``hybrid`` (``hybridize``: the Dense and Embedding layers of at
least 4 MiB sharded), and each with lms-tf keeping the optimizer's slots and update on the host
(``LMSCallback(optimizer_on_host=True)``: the ``+ lms`` rows). Each rank trains with Adam on its own
batch (8 images; 4 sequences) and measures its fifth step. It reports:

- **state**: the weights, their gradients and Adam's two moments the rank holds on the device,
  from the variables' shapes (the slots are not on the device with ``+ lms``);
- **real peak**: the rank's allocator over the step, the bytes in use when it started plus its peak
  above that. One op runs at a time, Horovod's fusion buffer and oneDNN are off, so the figure is
  the same from step to step;
- **sent per step**: the bytes this rank sends, from the collectives' shapes. A ring allreduce
  sends 2 (G-1)/G of its tensor (a row-sharded layer's bias is replicated); a sharded layer's
  allgathers, alltoalls and reducescatters send (G-1) / G of what they gather or scatter;
- **step time**: the median of steps 2-5. The G ranks share 2 CPU cores, so this is the overhead
  of the collectives and the sharded arithmetic, not a speed-up.

A second part plans **VGG16 at 224x224, global batch 16, at 25% of its one-GPU peak** on a V100
preset (no run: one process traces one rank's step, the collectives stood in for by local ops of
the same shapes, ``hybridize(planning=True)``). The one-GPU peak is the plain step's peak plus the
variables (SGD: no slots). Each 4-rank row gets 25% of that: its resident variables count against
it, and lms-tf plans the step into the rest. Each figure is judged twice: by the simulator and by
Grappler's virtual GPU (told the variable shapes; the rewritten step serialized in the planner's
order; in-place pairs counted once and variable reads, which are the variables' own buffers, not
counted: ``OraclePeak.step_peak_bytes``).

Command: ``.venv/bin/python benchmarks/hybrid.py`` (about 12 minutes; writes
``benchmarks/out/hybrid.json`` and the tables into ``docs/benchmarks/hybrid.md``);
``--only target`` runs the second part alone (about 2 minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RANK_JOB = "--rank-job"
MIN_PARAM_BYTES = 4 << 20
STEPS = 5
MiB = 2**20

if RANK_JOB in sys.argv:  # a rank: the settings that make one step's allocator peak repeatable
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"


def build(model_name: str):
    import keras

    keras.utils.set_random_seed(0)
    if model_name == "vgg16_cifar":
        inputs = keras.Input((32, 32, 3))
        features = keras.applications.VGG16(include_top=False, weights=None, input_tensor=inputs)
        h = keras.layers.Flatten()(features.output)
        h = keras.layers.Dense(4096, activation="relu", name="fc1")(h)
        h = keras.layers.Dense(4096, activation="relu", name="fc2")(h)
        return keras.Model(inputs, keras.layers.Dense(10, name="predictions")(h)), 8
    tokens = keras.Input((32,), dtype="int32")
    h = keras.layers.Embedding(8192, 256, name="embedding")(tokens)
    h = keras.layers.Dense(512, activation="relu", name="hidden")(h)
    return keras.Model(tokens, keras.layers.Dense(32768, name="projection")(h)), 4


def batch(model_name: str, size: int, rank: int):
    import numpy as np

    rng = np.random.default_rng(rank)
    if model_name == "vgg16_cifar":
        return rng.random((size, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, size)
    return rng.integers(0, 8192, (size, 32)).astype("int32"), rng.integers(0, 32768, (size, 32))


def sent_bytes(model, rows: int, ranks: int) -> int:
    """Bytes one rank sends per step: ring allreduces of the replicated gradients, and each
    sharded layer's collectives (float32 activations of ``rows`` rows per rank,
    :func:`lms_tf.parallel.sharded.sent_bytes_per_row`)."""
    import numpy as np

    from lms_tf.horovod import is_sharded
    from lms_tf.parallel import ShardedDense, ShardedEmbedding
    from lms_tf.parallel.sharded import sent_bytes_per_row

    if ranks == 1:
        return 0
    replicated = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_variables if not is_sharded(w))
    total = 2 * (ranks - 1) * replicated // ranks
    for layer in model.layers:
        if isinstance(layer, ShardedEmbedding):
            total += rows * sent_bytes_per_row(f"embedding_{layer.sharding}", 1, layer.output_dim, ranks)
        elif isinstance(layer, ShardedDense):
            features = layer.kernel.shape[0] * (ranks if layer.sharding == "rows" else 1)
            total += rows * sent_bytes_per_row(layer.sharding, features, layer.units, ranks)
    return total


def rank_job(model_name: str, variant: str, outdir: str) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import lms_tf
    from lms_tf.horovod import horovod_tensorflow
    from lms_tf.keras import DistributedCallback
    from lms_tf.parallel import hybridize

    hvd = horovod_tensorflow()
    rank, ranks = hvd.rank(), hvd.size()
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model, local = build(model_name)
    if variant.startswith("hybrid"):
        model = hybridize(model, min_param_bytes=MIN_PARAM_BYTES)
    model.compile(optimizer=keras.optimizers.Adam(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [DistributedCallback()]
    lms = variant.endswith("lms")
    if lms:
        callbacks.insert(0, lms_tf.LMSCallback(device="/CPU:0", host="/CPU:1", optimizer_on_host=True, swap=False))
    x, y = batch(model_name, local, rank)

    class Measure(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.started, self.block, self.memory = [], 0.0, None, None

        def on_train_batch_begin(self, step, logs=None):
            if step == STEPS - 1:
                self.block = lms_tf.measure_peak_memory("CPU:0", settle_seconds=0.3)
                self.memory = self.block.__enter__()
            self.started = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            float(logs["loss"])  # the step has finished
            self.times.append(time.perf_counter() - self.started)
            if step == STEPS - 1:
                self.block.__exit__(None, None, None)

    measure = Measure()
    data = tf.data.Dataset.from_tensors((x, y)).repeat(STEPS)
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks + [measure])
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    facts = dict(
        rank=rank, ranks=ranks, model=model_name, variant=variant, local_batch=local,
        weight_bytes=weights, state_bytes=weights * (2 if lms else 4),   # + gradients (+ 2 moments on the device)
        start_bytes=measure.memory.start_bytes - before, step_peak_bytes=measure.memory.peak_bytes,
        sent_bytes=sent_bytes(model, local * (32 if model_name == "text" else 1), ranks),
        step_s=float(np.median(measure.times[1:])),
        sharded_layers=list(model.hybrid_plan.sharded_layers) if hasattr(model, "hybrid_plan") else [])
    with open(os.path.join(outdir, f"{model_name}_{variant}_{ranks}_rank{rank}.json"), "w") as handle:
        json.dump(facts, handle)


JOBS = [(model, ranks, variant) for model in ("vgg16_cifar", "text") for ranks in (1, 2, 4)
        for variant in (("dp", "dp_lms") if ranks == 1 else ("dp", "dp_lms", "hybrid", "hybrid_lms"))]


def run_jobs(outdir: str) -> list:
    launcher = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    rows = []
    for number, (model, ranks, variant) in enumerate(JOBS, 1):
        print(f"[{number}/{len(JOBS)}] {model}, {ranks} rank(s), {variant}", flush=True)
        env = dict(os.environ, PYTHONPATH=ROOT)
        done = subprocess.run([launcher, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", sys.executable,
                               os.path.abspath(__file__), RANK_JOB, model, variant, outdir], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{model} {variant} at {ranks} ranks failed:\n{done.stderr[-4000:]}")
        for rank in range(ranks):
            with open(os.path.join(outdir, f"{model}_{variant}_{ranks}_rank{rank}.json")) as handle:
                rows.append(json.load(handle))
    return rows


def tables(rows: list) -> str:
    """One table per model: per variant and rank count, the largest rank's figures and the ratio
    of its state and real peak to pure data parallelism's at the same rank count."""
    text = []
    titles = {"vgg16_cifar": "VGG-16 at CIFAR-10 shape (33.6M parameters), 8 images per rank",
              "text": "Text model with an 8,192 x 256 embedding and a 32,768-token output projection (11.1M parameters), "
                     "4 x 32 tokens per rank"}
    names = {"dp": "data parallel", "dp_lms": "data parallel + lms", "hybrid": "hybrid",
             "hybrid_lms": "hybrid + lms"}
    for model in ("vgg16_cifar", "text"):
        text += [f"**{titles[model]}**", "",
                 "| ranks | variant | sharded | state per rank (MiB) | vs. data parallel | real peak per rank (MiB) | "
                 "vs. data parallel | sent per step per rank (MiB) | step (s) |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for ranks in (1, 2, 4):
            group = [r for r in rows if r["model"] == model and r["ranks"] == ranks]
            if not group:
                continue
            worst = {}
            for r in group:  # the rank that holds the most (they differ by their allocator's chunks)
                peak = r["start_bytes"] + r["step_peak_bytes"]
                if r["variant"] not in worst or peak > worst[r["variant"]][1]:
                    worst[r["variant"]] = (r, peak)
            base_state, base_peak = worst["dp"][0]["state_bytes"], worst["dp"][1]
            for variant in ("dp", "dp_lms", "hybrid", "hybrid_lms"):
                if variant not in worst:
                    continue
                r, peak = worst[variant]
                text.append(f"| {ranks} | {names[variant]} | {', '.join(r['sharded_layers']) or '-'} | "
                            f"{r['state_bytes'] / MiB:.1f} | {r['state_bytes'] / base_state:.2f} | {peak / MiB:.1f} | "
                            f"{peak / base_peak:.2f} | {r['sent_bytes'] / MiB:.1f} | {r['step_s']:.2f} |")
        text.append("")
    return "\n".join(text)


#: The 25% target: (name, ranks, per-rank batch, hybrid, weights). One GPU at batch 16 is the reference.
TARGET_ROWS = [("one GPU, plain", 1, 16, False, None),
               ("data parallel + lms-tf", 4, 4, False, "device"),
               ("data parallel + lms-tf, weights='auto'", 4, 4, False, "auto"),
               ("hybrid + lms-tf", 4, 4, True, "device"),
               ("hybrid + lms-tf, 16 per rank (global batch 64)", 4, 16, True, "device")]


def quarter_budget_target() -> list:
    """Plans each :data:`TARGET_ROWS` configuration at 25% of the one-GPU peak; see the docstring."""
    import tensorflow as tf

    import lms_tf
    from lms_tf.cli.workload import devices
    from lms_tf.core.errors import InfeasibleBudgetError
    from lms_tf.core.policy import Policies
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.parallel import hybridize
    from lms_tf.planner import make_budget_plan
    from lms_tf.simulate import resident_bytes, simulate
    from lms_tf.tf.diagnostics import virtual_gpu_peak_report
    from lms_tf.tf.trace import trace_step_ir
    from lms_tf.tf.workloads import build_model, synthetic_batch, train_step

    device, host = devices()
    spec = get_device_spec("v100-16gb-pcie3")
    cost = CostModel(spec)

    def oracle(concrete) -> int:
        return virtual_gpu_peak_report(concrete, host=host, gpu_memory_bytes=spec.memory_bytes,
                                       variable_shapes=True).step_peak_bytes

    rows, reference = [], None
    for number, (name, ranks, local, hybrid, weights) in enumerate(TARGET_ROWS, 1):
        print(f"[target {number}/{len(TARGET_ROWS)}] {name}", flush=True)
        model = build_model("VGG16", image_size=224, classes=1000)
        if hybrid:
            model = hybridize(model, group_size=ranks, planning=True)
        step = train_step(model)
        batch = synthetic_batch(model, local)
        ir = trace_step_ir(step, *batch)
        resident = resident_bytes(ir, ())
        plain = simulate(ir, cost=cost)
        row = dict(name=name, ranks=ranks, local_batch=local, resident_bytes=resident,
                   sharded=list(model.hybrid_plan.sharded_layers) if hybrid else [],
                   plain_peak_bytes=plain.peak_bytes)
        if reference is None:   # the one-GPU step: the 100% every other row is measured against
            row.update(total_bytes=resident + plain.peak_bytes,
                       oracle_total_bytes=resident + oracle(tf.function(step).get_concrete_function(*batch)))
            reference = row
            rows.append(row)
            continue
        target = reference["total_bytes"] // 4
        budget = target if weights == "auto" else target - resident   # 'auto' counts the variables itself
        row.update(target_bytes=target)
        if budget <= 0:
            row.update(feasible=False, why=f"its variables alone are {resident / reference['total_bytes']:.2f} of "
                                          f"the one-GPU peak")
            rows.append(row)
            continue
        try:
            plan = make_budget_plan(ir, Policies(host=host, budget=budget, recompute="auto", weights=weights),
                                    device=device, cost=cost)
        except InfeasibleBudgetError as error:
            floor = error.smallest_feasible_bytes + (0 if weights == "auto" else resident)
            row.update(feasible=False, why=f"the smallest feasible plan needs {floor / reference['total_bytes']:.2f} "
                                          f"of the one-GPU peak")
            rows.append(row)
            continue
        planned = simulate(ir, plan, cost=cost)
        on_device = resident - (plan.offloaded_weight_bytes if weights == "auto" else 0)
        fn = lms_tf.function(step, device=device, host=host, plan=plan, device_spec=spec, serialize=True,
                             weights=weights)
        row.update(feasible=True, total_bytes=on_device + planned.peak_bytes,
                   oracle_total_bytes=on_device + oracle(fn.get_concrete_function(*batch)),
                   overhead=planned.step_time_s / plain.step_time_s, swapped_bytes=plan.swapped_bytes,
                   recomputed_bytes=plan.recomputed_bytes)
        rows.append(row)
    return rows


def target_table(rows: list) -> str:
    reference = rows[0]
    text = ["**VGG16 224x224, global batch 16, on a V100 preset: planned at 25% of the one-GPU peak**", "",
            "| configuration | ranks | batch per rank | sharded | resident variables (MiB) | planned peak + "
            "variables (MiB), simulator | vs. one GPU | same, Grappler | vs. one GPU | predicted step time |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["name"], str(row["ranks"]), str(row["local_batch"]), ", ".join(row["sharded"]) or "-",
                 f"{row['resident_bytes'] / MiB:.1f}"]
        if row is reference:
            cells += [f"{row['total_bytes'] / MiB:.1f} (plain)", "1.00", f"{row['oracle_total_bytes'] / MiB:.1f}",
                      "1.00", "1.00"]
        elif not row["feasible"]:
            cells += [f"does not fit: {row['why']}", "-", "-", "-", "-"]
        else:
            cells += [f"{row['total_bytes'] / MiB:.1f}", f"{row['total_bytes'] / reference['total_bytes']:.2f}",
                      f"{row['oracle_total_bytes'] / MiB:.1f}",
                      f"{row['oracle_total_bytes'] / reference['oracle_total_bytes']:.2f}",
                      f"{row['overhead']:.2f}x"]
        text.append("| " + " | ".join(cells) + " |")
    return "\n".join(text) + "\n"


def main() -> None:
    from benchmarks.publish import OUT, publish

    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    started = time.perf_counter()
    os.makedirs(OUT, exist_ok=True)
    if only in (None, "ranks"):
        outdir = str(OUT / "hybrid")
        os.makedirs(outdir, exist_ok=True)
        rows = run_jobs(outdir)
        with open(OUT / "hybrid.json", "w") as handle:
            json.dump(rows, handle, indent=1)
        table = tables(rows)
        print(table)
        publish("hybrid", table, page="hybrid")
    if only in (None, "target"):
        rows = quarter_budget_target()
        with open(OUT / "hybrid_target.json", "w") as handle:
            json.dump(rows, handle, indent=1)
        table = target_table(rows)
        print(table)
        publish("hybrid-target", table, page="hybrid")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    if RANK_JOB in sys.argv:
        at = sys.argv.index(RANK_JOB)
        rank_job(*sys.argv[at + 1:at + 4])
    else:
        main()
