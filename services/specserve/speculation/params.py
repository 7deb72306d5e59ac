"""User-facing sampling parameters (validated; errors name the field)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): at T=1e-5 a logit gap of 0.001 already
# gives the runner-up a probability of e^-100; below it, logits / T overflows (T=1e-40 gave invalid tokens).
GREEDY_BELOW = 1e-5
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


def check_unicode(text: str) -> str:
    """Text must be encodable as UTF-8: JSON can carry a lone surrogate ("\\ud800"), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return text


class SamplingParams(BaseModel):
    """How the target's next-token distribution is turned into a sample.

    The transformations apply in the order temperature → top-k → top-p, the
    same order Hugging Face and vLLM use. Temperature 0 means greedy decoding.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(
        1.0, ge=0.0, allow_inf_nan=False,
        description="0 = greedy (argmax); >0 divides the logits. Below GREEDY_BELOW (1e-5) it is greedy too, as "
        "in vLLM: the logits divided by a tiny or subnormal temperature overflow to inf and NaN.",
    )
    top_k: int = Field(0, ge=0, le=2**31 - 1, description="Keep the k most probable tokens; 0 disables.")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Keep the smallest set of most probable tokens whose cumulative probability is ≥ top_p.",
    )
    seed: int | None = Field(
        None,
        ge=0,
        le=2**64 - 1,
        description="Makes sampling reproducible: same seed and same fixed γ give the same tokens.",
    )
    stop: list[str] | None = Field(None, description="Stop when the generated text contains one of these strings.")
    ignore_eos: bool = Field(False, description="Keep generating after the end-of-sequence token.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS,
        description="Report each emitted token's log-probability and the this-many most likely tokens at its "
        "position (None: none). From the target's raw distribution, before temperature, top-k and top-p; "
        "never changes which tokens are drawn.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value):
        if isinstance(value, str):
            value = [value]
        if value is not None and any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        if value is not None:
            for s in value:
                check_unicode(s)
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
