"""PoolingParams: what one embedding / scoring request asks of the pooler (vLLM's name)."""

from __future__ import annotations

from dataclasses import dataclass

from pkv.core.sample.sampling_params import check_truncate_prompt_tokens


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first N values of the embedding and renormalize (Matryoshka
    models only); `normalize`: None follows the model (sentence-transformers' Normalize
    module; with `dimensions`, normalized), True or False as asked; `activation`: apply the
    classifier's activation (sigmoid for one label, softmax for several) to a
    cross-encoder's logits."""

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool = True
    truncate_prompt_tokens: int | None = None  # as SamplingParams'

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        # (a string "false" is true: it would normalize what was asked not to be)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or None, got {self.normalize!r}")
        if not isinstance(self.activation, bool):
            raise ValueError(f"activation must be true or false, got {self.activation!r}")
