"""The schema's building blocks: strict number types, the choice literals, and the frozen section base."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, Strict

# Strict numbers: a bool or a quoted "1e-4" is an error, not silently a number.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
PosFloat = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
PosNumber = Union[PosInt, PosFloat]  # a whole number stays one (specs print as they were written)
NonNegFloat = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
LrRule = Literal["linear", "sqrt", "none"]
Auto = Literal["auto"]


class Section(BaseModel):
    """A part of the spec: unknown keys are errors, and a loaded spec never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
