"""How coarsely the ``cachegen`` codec quantizes each layer's keys and values."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepSchedule"]


@dataclass(frozen=True, slots=True)
class StepSchedule:
    """Quantization steps of one ``cachegen`` level, relative to the data's spread.

    Layers are split by depth into thirds (shallow, middle, deep); each third has its own step
    for keys and for values. Keys get one step per layer, ``key_steps[g]`` times the geometric
    mean of the layer's channel standard deviations; values get one step per channel,
    ``value_steps[g]`` times that channel's standard deviation. Both choices were measured on
    SmolLM2-135M (see the codec report in docs/benchmarks.md): per-channel key steps gave twice
    the KL for 3% fewer bytes; per-layer value steps gave 40% more KL and 1% more bytes.

    >>> StepSchedule((0.3, 0.3, 0.3), (0.3, 1.0, 1.0)).group(29, 30)
    2
    """

    key_steps: tuple[float, float, float]  # step / geometric-mean sigma, per depth third
    value_steps: tuple[float, float, float]  # step / channel sigma, per depth third
    zstd_level: int = 0  # 0: the tuned btultra parameters; otherwise a plain zstd level
    # Salient tokens (ZipCache): this share of a chunk's tokens, the most salient, is quantized
    # with steps 2 ** salient_shift times finer than the rest (format 3 on; 0.0: none).
    salient_share: float = 0.0
    salient_shift: int = 0

    def __post_init__(self) -> None:
        for steps in (self.key_steps, self.value_steps):
            if len(steps) != 3 or not all(s > 0 for s in steps):
                raise ValueError("StepSchedule needs three positive steps for keys and for values")
        if not 0.0 <= self.salient_share <= 1.0 or self.salient_shift not in range(0, 5):
            raise ValueError("StepSchedule needs salient_share in [0, 1] and salient_shift in 0..4")

    @staticmethod
    def group(layer: int, num_layers: int) -> int:
        """Depth third (0 shallow, 1 middle, 2 deep) of ``layer`` among ``num_layers``."""
        return min(2, (3 * layer) // max(1, num_layers))
