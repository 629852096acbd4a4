"""mCAP's calibration: the per-layer memory model matched to a real allocator at one and two micro-batches.

The per-layer model predicts a stage's peak as a fixed part (weights, their gradients and the
optimizer's slots, the largest working set) plus one copy of its kept activations per
micro-batch in flight (:mod:`lms_tf.pipeline.partition`). mCAP reads a stage's real peak with one
and with two micro-batches in flight and extrapolates linearly: the difference is what one more
micro-batch really holds, and ``2 * p1 - p2`` is the real fixed part. lms-tf does the same on the
whole model as one GPipe stage: two real steps, instead of mCAP's one profiling run per layer.

:meth:`Calibration.apply` carries the two real figures back into the per-layer profile, so every
stage of every cut the search tries is counted with them:

* every activation (what a layer keeps and what it receives, per micro-batch) is scaled by
  ``activation_scale``, the real bytes per micro-batch over the predicted (the allocator's whole
  chunks, tensors the trace does not show);
* ``fixed_offset_bytes``, the real fixed part less the predicted one, is added once to every
  stage's working set (kernel scratch the model does not know, the runtime's own buffers: what
  each stage's process holds whatever its layers). Weights, gradients and slots have exact sizes
  and are not touched.

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

from lms_tf.core.errors import LMSError
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
    """The whole model's real peak as one GPipe stage at one and two micro-batches in flight, beside the
    per-layer model's prediction of the same.

    Attributes:
        measured: The real peaks (bytes, weights and slots included) with 1 and 2 micro-batches in flight.
        predicted: The per-layer model's peaks of the same stage.
        device: The device whose allocator was read (``"CPU:0"``, ``"GPU:0"``).

    Raises:
        LMSError: The real peak with two micro-batches in flight is not above the one with one (the
            runs did not hold what a micro-batch keeps: nothing to extrapolate from).

    Examples:
        >>> c = Calibration(measured=(300, 550), predicted=(240, 440), device="CPU:0")
        >>> c.activation_scale, c.fixed_offset_bytes
        (1.25, 10)
    """

    measured: Tuple[int, int]
    predicted: Tuple[int, int]
    device: str = "CPU:0"

    def __post_init__(self):
        (one, two), (p_one, p_two) = self.measured, self.predicted
        if self.resolves_activations and two <= one:
            raise LMSError(f"calibration on {self.device}: the real peak with two micro-batches in flight "
                           f"({format_bytes(two)}) is not above the one with one ({format_bytes(one)}), though the "
                           f"per-layer model counts {format_bytes(p_two - p_one)} per micro-batch; the peak is not "
                           f"where the activations are (check that nothing else ran on {self.device} meanwhile), "
                           f"so partition without calibrate.")

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
    def activation_scale(self) -> float:
        """Real bytes one more micro-batch holds over the per-layer model's (1.0 when the two runs
        cannot resolve them, :attr:`resolves_activations`).

        Examples:
            >>> Calibration((300, 500), (200, 400)).activation_scale
            1.0
            >>> Calibration((300, 550), (240, 440)).activation_scale
            1.25
        """
        if not self.resolves_activations:
            return 1.0
        return (self.measured[1] - self.measured[0]) / (self.predicted[1] - self.predicted[0])

    @property
    def fixed_offset_bytes(self) -> int:
        """The real fixed part less the per-layer model's, added once to every stage: ``(2 * p1 - p2)``
        less the model's, or the mean of the two runs' differences when the activations are not
        resolved.

        Examples:
            >>> Calibration((300, 500), (200, 400)).fixed_offset_bytes
            100
            >>> Calibration((105, 102), (102, 104)).fixed_offset_bytes
            0
        """
        (one, two), (p_one, p_two) = self.measured, self.predicted
        if not self.resolves_activations:
            return round((one - p_one + two - p_two) / 2)
        return (2 * one - two) - (2 * p_one - p_two)

    def extrapolate(self, in_flight: int) -> int:
        """The whole model's peak with ``in_flight`` micro-batches, extrapolated linearly (mCAP) from
        the real fixed part and bytes per micro-batch.

        Examples:
            >>> Calibration((300, 500), (200, 400)).extrapolate(8)
            1700
        """
        p_one, p_two = self.predicted
        fixed = 2 * p_one - p_two + self.fixed_offset_bytes
        return fixed + round(in_flight * (p_two - p_one) * self.activation_scale)

    def apply(self, profile: PipelineProfile) -> PipelineProfile:
        """``profile`` with every activation scaled and every layer's working set offset (see the module
        docstring), so a stage's peak counts the real figures. Weights are not touched, and a working
        set does not go below zero: where the real fixed part is under the model's by more than a
        layer's working set, a stage of such layers stays counted above the real figure (the safe
        side for a cut).

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
            work_bytes=max(0, layer.work_bytes + offset)) for layer in profile.layers)
        return dataclasses.replace(profile, layers=layers)

    def to_dict(self) -> Dict[str, Any]:
        """Plain data, as ``lms-tf partition --json`` prints it under ``calibration``.

        Examples:
            >>> sorted(Calibration((300, 500), (200, 400)).to_dict())
            ['activation_scale', 'device', 'fixed_offset_bytes', 'measured_peak_bytes', 'predicted_peak_bytes']
        """
        return {"device": self.device, "measured_peak_bytes": list(self.measured),
                "predicted_peak_bytes": list(self.predicted), "activation_scale": self.activation_scale,
                "fixed_offset_bytes": self.fixed_offset_bytes}

    def describe(self) -> str:
        """One line for a partition's summary.

        Examples:
            >>> print(Calibration((300 * 2**20, 500 * 2**20), (200 * 2**20, 400 * 2**20)).describe())
            calibrated on CPU:0: real 300.0 MiB / 500.0 MiB at 1 / 2 micro-batches (per-layer model 200.0 MiB / 400.0 MiB): activations x1.00, +100.0 MiB per stage
        """
        offset = self.fixed_offset_bytes
        return (f"calibrated on {self.device}: real {format_bytes(self.measured[0])} / {format_bytes(self.measured[1])} "
                f"at 1 / 2 micro-batches (per-layer model {format_bytes(self.predicted[0])} / "
                f"{format_bytes(self.predicted[1])}): activations x{self.activation_scale:.2f}, "
                f"{'+' if offset >= 0 else '-'}{format_bytes(abs(offset))} per stage")
