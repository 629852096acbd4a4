"""Accelerator descriptions (:class:`DeviceSpec`) and named presets for the planner.

Figures are vendor datasheet peaks (dense, no sparsity) and achieved host-link bandwidths,
per direction. Sources:

* V100: NVIDIA Tesla V100 datasheet (PCIe: 14 TFLOP/s FP32, 112 FP16 tensor; SXM2: 15.7 /
  125; HBM2 900 GB/s). PCIe Gen3 x16 moves about 12 GB/s each way in practice (15.75
  theoretical); the IBM AC922 (POWER9) links CPU and V100 with NVLink 2.0 at 75 GB/s each
  way (three 25 GB/s bricks), the link TFLMS was measured on.
* A100: NVIDIA A100 datasheet (19.5 TFLOP/s FP32, 156 TF32, 312 FP16/BF16; 1,555 GB/s for
  40 GB, 1,935 GB/s for 80 GB PCIe). PCIe Gen4 x16: about 25 GB/s achieved (31.5 theoretical).
* H100 PCIe: NVIDIA H100 datasheet (51 TFLOP/s FP32, 378 TF32, 756 FP16/BF16 dense; HBM2e
  2.0 TB/s). PCIe Gen5 x16: about 50 GB/s achieved (63 theoretical).
* H200 NVL (PCIe): NVIDIA H200 datasheet (60 TFLOP/s FP32, 418 TF32, 835 FP16/BF16 dense;
  HBM3e 4.8 TB/s, 141 GB). PCIe Gen5 x16 as above.
* GH200: NVIDIA GH200 Grace Hopper datasheet (H100 SXM-class GPU: 67 TFLOP/s FP32, 494 TF32,
  989 FP16/BF16 dense; 96 GB HBM3 at 4 TB/s); NVLink-C2C 900 GB/s total, 450 GB/s each way.
* Between two devices of a machine (what a gradient allreduce on the devices uses): the AC922's
  GPUs are linked by NVLink 2.0 as their CPU is (75 GB/s each way); H200 NVL cards by an NVLink
  bridge and GH200s by NVLink (900 GB/s total, 450 each way). The PCIe cards (V100, A100, H100)
  reach each other over PCIe, the link their copies to the host use, at its bandwidth.

``memory_bytes`` is the capacity the driver reports (``nvidia-smi``'s total), rounded down to a
MiB; TensorFlow can allocate almost all of it. TensorFlow runs float32 matmuls and convolutions
as TF32 on Ampere and newer by default, so ``float32`` matmul FLOP/s are TF32 there.

Examples:
    >>> spec = get_device_spec("v100-16gb-pcie3")
    >>> spec.memory_bytes // 2**30, spec.host_to_device_bytes_per_s / 1e9
    (15, 12.0)
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, Mapping, Optional, Union

from lms_tf.core.errors import LMSOptionError

GB = 10**9
TERA = 10**12
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """An accelerator and its link to the host, as the cost model sees it.

    Args:
        name: Preset name or a description.
        memory_bytes: Device memory the driver reports.
        matmul_flops: Peak FLOP/s of matmuls and convolutions per dtype name
            (``"float32"``, ``"float16"``, ``"bfloat16"``).
        vector_flops: Peak FLOP/s of elementwise and reduction math per dtype name.
        memory_bytes_per_s: Device memory bandwidth.
        host_to_device_bytes_per_s: Achieved host -> device copy bandwidth.
        device_to_host_bytes_per_s: Achieved device -> host copy bandwidth.
        launch_overhead_s: Fixed time per kernel (launch and scheduling).
        source: Where the figures come from.
        host_memory_bytes: Memory of the host the device is in (None: unknown).
        host_memory_bytes_per_s: The host's achieved memory bandwidth, which times the
            optimizer update when it runs on the host (None: that update takes no time).
        peer_bytes_per_s: Bandwidth between two such devices in one machine, each way, as a
            collective (NCCL's ring) uses it: NVLink where the devices have it, else PCIe
            (None: unknown).
        peer_over_host_link: Whether that traffic crosses the link to the host, which the
            swap and weight copies use (PCIe cards without a bridge: yes).
        cudnn_workspace_limit_bytes: The most scratch memory cuDNN may take for one convolution
            (TensorFlow's ``TF_CUDNN_WORKSPACE_LIMIT_IN_MB``, which it reads once per process);
            None: no cap, and the simulator counts about the convolution's largest operand.
            :func:`get_device_spec` sets it from that variable when the process has it.

    Examples:
        >>> DeviceSpec("toy", 2**30, {"float32": 1e12}, {"float32": 1e12}, 1e11, 1e10, 1e10).flops("float32")
        1000000000000.0
    """

    name: str
    memory_bytes: int
    matmul_flops: Mapping[str, float]
    vector_flops: Mapping[str, float]
    memory_bytes_per_s: float
    host_to_device_bytes_per_s: float
    device_to_host_bytes_per_s: float
    launch_overhead_s: float = 5e-6
    source: str = ""
    host_memory_bytes: Optional[int] = None
    host_memory_bytes_per_s: Optional[float] = None
    peer_bytes_per_s: Optional[float] = None
    peer_over_host_link: bool = True
    cudnn_workspace_limit_bytes: Optional[int] = None

    def flops(self, dtype: str, matmul: bool = True) -> float:
        """Peak FLOP/s for ``dtype`` (float32 figures for dtypes the table does not list).

        Examples:
            >>> get_device_spec("a100-40gb-pcie4").flops("float16") / 1e12
            312.0
        """
        table = self.matmul_flops if matmul else self.vector_flops
        return float(table.get(dtype, table["float32"]))

    def to_dict(self) -> Dict[str, object]:
        """The spec as plain data.

        Examples:
            >>> get_device_spec("gh200-96gb-c2c").to_dict()["host_to_device_bytes_per_s"] / 1e9
            450.0
        """
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in dataclasses.asdict(self).items()}


def _spec(name, memory_mib, fp32, tf32, fp16, vector_fp32, bandwidth_gb, link_gb, host_gb, host_gb_per_s, source,
          peer_gb=None):
    # peer_gb: an NVLink between the devices, each way; without one they talk over the host link.
    matmul = {"float32": tf32 * TERA, "float16": fp16 * TERA, "bfloat16": fp16 * TERA,
              "float64": fp32 / 2 * TERA}
    vector = {"float32": vector_fp32 * TERA, "float16": 2 * vector_fp32 * TERA, "bfloat16": 2 * vector_fp32 * TERA}
    return DeviceSpec(name, memory_mib * MiB, matmul, vector, bandwidth_gb * GB, link_gb * GB, link_gb * GB,
                      source=source, host_memory_bytes=host_gb * GB, host_memory_bytes_per_s=host_gb_per_s * GB,
                      peer_bytes_per_s=(peer_gb or link_gb) * GB, peer_over_host_link=peer_gb is None)


#: Named device presets (see the module docstring for sources).
PRESETS: Dict[str, DeviceSpec] = {s.name: s for s in (
    _spec("v100-16gb-pcie3", 16160, 14.0, 14.0, 112.0, 14.0, 900, 12.0, 384, 150, "V100 PCIe datasheet; PCIe Gen3 x16 achieved"),
    _spec("v100-32gb-nvlink2", 32510, 15.7, 15.7, 125.0, 15.7, 900, 75.0, 512, 270,
          "V100 SXM2 datasheet; NVLink 2.0 CPU-GPU on POWER9 (AC922), 3 bricks x 25 GB/s", peer_gb=75.0),
    _spec("a100-40gb-pcie4", 40536, 19.5, 156.0, 312.0, 19.5, 1555, 25.0, 1000, 300, "A100 PCIe datasheet; PCIe Gen4 x16 achieved"),
    _spec("a100-80gb-pcie4", 81920, 19.5, 156.0, 312.0, 19.5, 1935, 25.0, 1000, 300, "A100 80GB PCIe datasheet; PCIe Gen4 x16"),
    _spec("h100-80gb-pcie5", 81559, 51.0, 378.0, 756.0, 51.0, 2000, 50.0, 2000, 450, "H100 PCIe datasheet; PCIe Gen5 x16 achieved"),
    _spec("h200-141gb-pcie5", 143771, 60.0, 418.0, 835.0, 60.0, 4800, 50.0, 2000, 450,
          "H200 NVL datasheet; PCIe Gen5 x16; NVLink bridge 900 GB/s", peer_gb=450.0),
    _spec("gh200-96gb-c2c", 97871, 67.0, 494.0, 989.0, 67.0, 4000, 450.0, 480, 450,
          "GH200 datasheet (H100 SXM-class GPU); NVLink-C2C 450 GB/s each way; NVLink 900 GB/s", peer_gb=450.0),
)}


def _match_gpu_name(gpu_name: str, memory_bytes: Optional[int]) -> Optional[DeviceSpec]:
    """Maps a CUDA device name (e.g. 'NVIDIA A100-PCIE-40GB') to the closest preset."""
    text = gpu_name.lower()
    family = next((f for f in ("gh200", "h200", "h100", "a100", "v100") if f in text), None)
    if family is None:
        return None
    candidates = [s for s in PRESETS.values() if s.name.startswith(family)]
    size = re.search(r"(\d+)\s*gb", text)
    if size:
        sized = [s for s in candidates if s.name.split("-")[1] == f"{size.group(1)}gb"]
        candidates = sized or candidates
    if "sxm" in text or "nvlink" in text:
        candidates = [s for s in candidates if "nvlink" in s.name] or candidates
    spec = candidates[0]
    if memory_bytes:
        spec = dataclasses.replace(spec, memory_bytes=memory_bytes)
    return spec


def detect_device_spec() -> DeviceSpec:
    """The preset of the first visible GPU (``device_spec="auto"``).

    Raises:
        LMSOptionError: No GPU is visible, or its name matches no preset.

    Examples:
        >>> import tensorflow as tf
        >>> if not tf.config.list_physical_devices("GPU"):
        ...     detect_device_spec()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: device_spec='auto' needs a visible GPU...
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise LMSOptionError(
            f"device_spec='auto' needs a visible GPU, and TensorFlow sees none. Name a preset instead, one of "
            f"{', '.join(PRESETS)}, or pass an lms_tf.cost.DeviceSpec.")
    details = tf.config.experimental.get_device_details(gpus[0])
    name = details.get("device_name", "")
    spec = _match_gpu_name(name, None)
    if spec is None:
        raise LMSOptionError(
            f"device_spec='auto': the GPU {name!r} matches no preset ({', '.join(PRESETS)}). Pass the closest "
            f"preset name, or an lms_tf.cost.DeviceSpec with its figures.")
    return spec


#: TensorFlow's cap on cuDNN's convolution workspace, in MiB (read once per process, at the first
#: convolution of each kind).
WORKSPACE_LIMIT_VARIABLE = "TF_CUDNN_WORKSPACE_LIMIT_IN_MB"


def process_workspace_limit() -> Optional[int]:
    """The cap on cuDNN's convolution workspace this process gives TensorFlow, in bytes
    (``TF_CUDNN_WORKSPACE_LIMIT_IN_MB``), or None when it sets none.

    Raises:
        LMSOptionError: The variable is set to something other than a whole number of MiB.

    Examples:
        >>> import os
        >>> os.environ.pop(WORKSPACE_LIMIT_VARIABLE, None) and None
        >>> process_workspace_limit() is None
        True
    """
    text = os.environ.get(WORKSPACE_LIMIT_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise LMSOptionError(f"{WORKSPACE_LIMIT_VARIABLE} must be a whole number of MiB (TensorFlow's cap on cuDNN's "
                             f"convolution workspace); it is {text!r}. Set it to e.g. 64, or unset it.")
    return int(text) << 20


def with_process_workspace_limit(spec: DeviceSpec) -> DeviceSpec:
    """``spec`` with :attr:`DeviceSpec.cudnn_workspace_limit_bytes` set from this process's
    ``TF_CUDNN_WORKSPACE_LIMIT_IN_MB``, when it sets one (TensorFlow will cap cuDNN's workspace there).

    Examples:
        >>> import os
        >>> os.environ[WORKSPACE_LIMIT_VARIABLE] = "64"
        >>> with_process_workspace_limit(get_device_spec("v100-16gb-pcie3")).cudnn_workspace_limit_bytes // 2**20
        64
        >>> del os.environ[WORKSPACE_LIMIT_VARIABLE]
    """
    limit = process_workspace_limit()
    return spec if limit is None else dataclasses.replace(spec, cudnn_workspace_limit_bytes=limit)


def get_device_spec(spec: Union[str, DeviceSpec]) -> DeviceSpec:
    """Resolves a preset name, ``"auto"`` or a :class:`DeviceSpec` to a DeviceSpec.

    A preset or ``"auto"`` takes the cap on cuDNN's workspace this process gives TensorFlow
    (:func:`with_process_workspace_limit`); a DeviceSpec is used as given.

    Raises:
        LMSOptionError: An unknown preset name or a value of the wrong type.

    Examples:
        >>> get_device_spec("h100-80gb-pcie5").name
        'h100-80gb-pcie5'
        >>> get_device_spec("v100")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: unknown device preset 'v100'...
    """
    if isinstance(spec, DeviceSpec):
        return spec
    if spec == "auto":
        return with_process_workspace_limit(detect_device_spec())
    if isinstance(spec, str) and spec in PRESETS:
        return with_process_workspace_limit(PRESETS[spec])
    if isinstance(spec, str):
        import difflib

        close = difflib.get_close_matches(spec, PRESETS, n=1, cutoff=0.3)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise LMSOptionError(f"unknown device preset {spec!r}.{hint} Presets: {', '.join(PRESETS)}; or 'auto' "
                             f"(the visible GPU), or an lms_tf.cost.DeviceSpec.")
    raise LMSOptionError(f"device_spec must be a preset name, 'auto' or an lms_tf.cost.DeviceSpec; received "
                         f"{spec!r} ({type(spec).__name__}).")
