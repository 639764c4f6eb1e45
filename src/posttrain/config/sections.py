"""The base classes of every config node: unknown keys are errors, field docstrings are the help text, and a
number given as a boolean, NaN or infinity is an error naming the key.

The bottom of the package's layer table (docs in ARCHITECTURE.md): imports pydantic and the standard library only.
"""

from __future__ import annotations

from typing import Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    """Base of every config node: unknown keys are errors, field docstrings are the help text, and a number
    given as NaN or infinity is an error wherever one is read (`trainer.learning_rate=inf` would train NaN)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


class NumericSection(Section):
    """A section of thresholds, coefficients and counts, where a boolean given for a number is an error naming the
    key: pydantic would otherwise read `loss.ratio_clip_low=true` as 1.0 and `trainer.max_steps=true` as 1."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if get_origin(annotation) is dict and isinstance(value, dict):
            flagged = [key for key, item in value.items() if _boolean_for_number(get_args(annotation)[1], item)]
            if flagged:
                raise ValueError(f"expected a number for {flagged[0]!r}, got the boolean {value[flagged[0]]!r}")
        elif _boolean_for_number(annotation, value):
            raise ValueError(f"expected a number, got the boolean {value!r}")
        return value


def _boolean_for_number(annotation: Any, value: Any) -> bool:
    """True when `value` is a bool where `annotation` expects an int or a float (bool alone is an int to Python)."""
    args = get_args(annotation)
    return isinstance(value, bool) and bool({annotation, *args} & {int, float}) and bool not in args


