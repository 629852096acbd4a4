"""Calibration on a real allocator (mCAP's two runs): the per-layer memory model raised to cover what
the allocator really holds with one and two micro-batches in flight.

The per-layer model predicts a stage's peak as a fixed part (weights, their gradients and the
optimizer's slots, the largest working set) plus one copy of its kept activations per
micro-batch in flight (:mod:`lms_tf.pipeline.partition`). mCAP reads a stage's real peak with one
and with two micro-batches in flight and extrapolates linearly from those two figures alone
(:meth:`Calibration.mcap_extrapolate`). lms-tf reads the same two figures, on the whole model as
one stage (two real steps, not mCAP's profiling run per layer), but uses them to *raise* the
per-layer model, never to lower it: on this repository's benchmark, mCAP's line under-predicted two
held-out models by up to 36% (at one micro-batch in flight the peak sits in a backward working set,
not in the activations, so the line's slope is too shallow), where the per-layer model was within
0.97-1.14x. Lowering a prediction risks a stage that does not fit; raising it costs at most balance.

:meth:`Calibration.apply` carries the two real figures back into the per-layer profile, so every
stage of every cut the search tries is counted with them:

* every activation (what a layer keeps and what it receives, per micro-batch) is scaled by
  ``activation_scale``: the real bytes one more micro-batch holds over the predicted, where that
  is above 1 (the allocator's whole chunks, tensors the trace does not show);
* ``fixed_offset_bytes`` is added once to every stage's working set: the least bytes (0 or more)
  that make the scaled model cover both real runs (kernel scratch the model does not know, the
  runtime's own buffers: what each stage's process holds whatever its layers). Weights,
  gradients and slots have exact sizes and are not touched.

So a calibrated stage is never counted below the per-layer model, and the whole model as one stage
is never counted below either real run.

No TensorFlow here: :func:`lms_tf.tf.pipeline.measure_calibration` runs the two steps.

Examples:
    >>> from lms_tf.pipeline.profile import PipelineProfile
    >>> profile = PipelineProfile.chain([100, 100], [10, 10])   # predicted: 40 + n * 200
    >>> calibration = Calibration.from_profile(profile, measured=(300, 550))   # real: 50 + n * 250
    >>> calibration.activation_scale, calibration.fixed_offset_bytes, calibration.extrapolate(4)
    (1.25, 10, 1050)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

from lms_tf.core.policy import format_bytes
from lms_tf.pipeline.partition import stage_peak
from lms_tf.pipeline.profile import PipelineProfile

#: Micro-batches in flight of the two real runs (mCAP's).
CALIBRATION_IN_FLIGHT = (1, 2)
#: The least share of the peak one more micro-batch must hold, by the per-layer model, for two real
#: runs to calibrate it (see :attr:`Calibration.resolves_activations`).
RESOLVABLE_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The whole model's real peak as one stage with one and with two micro-batches in flight, beside
    the per-layer model's prediction of the same.

    Attributes:
        measured: The real peaks (bytes, weights and slots included) with 1 and 2 micro-batches in flight.
        predicted: The per-layer model's peaks of the same stage.
        device: The device whose allocator was read (``"CPU:0"``, ``"GPU:0"``).
        op_time_scale: Per op class, measured kernel time over the cost model's on that device
            (:meth:`lms_tf.cost.CostModel.calibrate`), which the profile's op times were taken with.

    Examples:
        >>> c = Calibration(measured=(300, 550), predicted=(240, 440), device="CPU:0")
        >>> c.activation_scale, c.fixed_offset_bytes
        (1.25, 10)
        >>> Calibration(measured=(300, 400), predicted=(240, 440)).activation_scale   # lowers nothing
        1.0
    """

    measured: Tuple[int, int]
    predicted: Tuple[int, int]
    device: str = "CPU:0"
    op_time_scale: Tuple[Tuple[str, float], ...] = ()

    @classmethod
    def from_profile(cls, profile: PipelineProfile, measured: Tuple[int, int], device: str = "CPU:0") -> "Calibration":
        """The calibration of ``profile`` from the real peaks of the whole model as one stage.

        Examples:
            >>> from lms_tf.pipeline.profile import PipelineProfile
            >>> Calibration.from_profile(PipelineProfile.chain([100]), (150, 260)).predicted
            (100, 200)
        """
        n = len(profile.layers)
        predicted = tuple(stage_peak(profile, 0, n, flight) for flight in CALIBRATION_IN_FLIGHT)
        return cls(measured=tuple(int(b) for b in measured), predicted=predicted, device=device)

    @property
    def resolves_activations(self) -> bool:
        """Whether one more micro-batch holds enough, by the per-layer model, to be read off two real
        peaks: at least :data:`RESOLVABLE_SHARE` of the peak. Below it the allocator's whole chunks
        and the order its frees land in move the peak by as much (a weight-heavy MLP's two runs
        read 105.2 and 102.0 MiB, where the model counts 1.7 MiB per micro-batch), so only the
        fixed part is calibrated.

        Examples:
            >>> Calibration((300, 500), (200, 400)).resolves_activations
            True
            >>> Calibration((105, 102), (102, 104)).resolves_activations
            False
        """
        p_one, p_two = self.predicted
        return p_two - p_one >= RESOLVABLE_SHARE * p_one

    @property
    def mcap_scale(self) -> float:
        """Real bytes one more micro-batch holds over the per-layer model's, as the two runs read
        (mCAP's slope; 1.0 when they cannot resolve it, :attr:`resolves_activations`).

        Examples:
            >>> Calibration((300, 400), (240, 440)).mcap_scale
            0.5
        """
        if not self.resolves_activations:
            return 1.0
        return (self.measured[1] - self.measured[0]) / (self.predicted[1] - self.predicted[0])

    @property
    def activation_scale(self) -> float:
        """What every activation is scaled by: :attr:`mcap_scale` where it is above 1, else 1.

        Examples:
            >>> Calibration((300, 550), (240, 440)).activation_scale
            1.25
        """
        return max(1.0, self.mcap_scale)

    @property
    def fixed_offset_bytes(self) -> int:
        """The bytes added once to every stage: the least (0 or more) that make the per-layer model,
        activations scaled, cover both real runs.

        Examples:
            >>> Calibration((300, 500), (200, 400)).fixed_offset_bytes
            100
            >>> Calibration((105, 102), (102, 104)).fixed_offset_bytes   # covers the run at one
            3
        """
        (p_one, p_two), scale = self.predicted, self.activation_scale
        per_microbatch, fixed = p_two - p_one, 2 * p_one - p_two
        shortfall = max(real - (fixed + round(flight * per_microbatch * scale))
                        for flight, real in zip(CALIBRATION_IN_FLIGHT, self.measured))
        return max(0, shortfall)

    def extrapolate(self, in_flight: int) -> int:
        """The whole model's calibrated peak with ``in_flight`` micro-batches (what :meth:`apply`'s
        profile counts for it, up to rounding each tensor).

        Examples:
            >>> Calibration((300, 500), (200, 400)).extrapolate(8)
            1700
        """
        p_one, p_two = self.predicted
        return 2 * p_one - p_two + self.fixed_offset_bytes + round(in_flight * (p_two - p_one) * self.activation_scale)

    def mcap_extrapolate(self, in_flight: int) -> int:
        """mCAP's figure: the line through the two real runs, extended to ``in_flight`` micro-batches.

        Examples:
            >>> Calibration((300, 400), (240, 440)).mcap_extrapolate(4), Calibration((300, 400), (240, 440)).extrapolate(4)
            (600, 900)
        """
        one, two = self.measured
        return one + (in_flight - 1) * (two - one)

    def apply(self, profile: PipelineProfile) -> PipelineProfile:
        """``profile`` with every activation scaled and every layer's working set raised (see the
        module docstring), so a stage's peak counts the real figures. Weights are not touched.

        Examples:
            >>> from lms_tf.pipeline.profile import PipelineProfile
            >>> from lms_tf.pipeline.partition import stage_peak
            >>> profile = PipelineProfile.chain([100, 100], [10, 10])
            >>> calibrated = Calibration.from_profile(profile, (300, 550)).apply(profile)
            >>> [stage_peak(calibrated, 0, 2, n) for n in (1, 2, 4)]
            [300, 550, 1050]
        """
        scale, offset = self.activation_scale, self.fixed_offset_bytes

        def scaled(nbytes: int) -> int:
            return int(round(nbytes * scale))

        layers = tuple(dataclasses.replace(
            layer, saved=tuple((name, scaled(nbytes)) for name, nbytes in layer.saved),
            inputs=tuple((name, scaled(nbytes), producer) for name, nbytes, producer in layer.inputs),
            work_bytes=layer.work_bytes + offset) for layer in profile.layers)
        return dataclasses.replace(profile, layers=layers)

    def to_dict(self) -> Dict[str, Any]:
        """Plain data, as ``lms-tf partition --json`` prints it under ``calibration``.

        Examples:
            >>> sorted(Calibration((300, 500), (200, 400)).to_dict())[:4]
            ['activation_scale', 'device', 'fixed_offset_bytes', 'mcap_scale']
        """
        return {"device": self.device, "measured_peak_bytes": list(self.measured),
                "predicted_peak_bytes": list(self.predicted), "mcap_scale": self.mcap_scale,
                "activation_scale": self.activation_scale, "fixed_offset_bytes": self.fixed_offset_bytes,
                "resolves_activations": self.resolves_activations, "op_time_scale": dict(self.op_time_scale)}

    def describe(self) -> str:
        """One line for a partition's summary.

        Examples:
            >>> print(Calibration((300 * 2**20, 500 * 2**20), (200 * 2**20, 400 * 2**20)).describe())
            calibrated on CPU:0: real 300.0 MiB / 500.0 MiB at 1 / 2 micro-batches (per-layer model 200.0 MiB / 400.0 MiB): activations x1.00, +100.0 MiB per stage
        """
        times = (f"; op times x{min(f for _, f in self.op_time_scale):.3g}-{max(f for _, f in self.op_time_scale):.3g} "
                 f"by class" if self.op_time_scale else "")
        return (f"calibrated on {self.device}: real {format_bytes(self.measured[0])} / {format_bytes(self.measured[1])} "
                f"at 1 / 2 micro-batches (per-layer model {format_bytes(self.predicted[0])} / "
                f"{format_bytes(self.predicted[1])}): activations x{self.activation_scale:.2f}, "
                f"+{format_bytes(self.fixed_offset_bytes)} per stage{times}")
