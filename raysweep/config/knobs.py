"""Search-space knobs: a knob is a plain value (fixed) or exactly one distribution (choice, uniform, loguniform,
randint); the value `train` runs and a search's extremes are read from here."""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar, Union

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from raysweep.config.fields import PosFloat, PosInt, Section

T = TypeVar("T")


class Choice(Section, Generic[T]):
    """`{choice: [a, b, ...], default: a}`: one of the listed values."""

    choice: list[T] = Field(min_length=1, description="candidate values")
    default: T | None = Field(None, description="value for `train` and the first tune trial")
    max: PosInt | Literal["probe"] | None = Field(
        None, description="per_gpu_batch_size only: larger samples run as max × more accumulation; probe → measure it"
    )

    @model_validator(mode="after")
    def _default_in_choices(self):
        if self.default is not None and self.default not in self.choice:
            raise ValueError(f"default {self.default!r} is not one of the choices {self.choice}")
        return self

    def first(self):
        return self.default if self.default is not None else self.choice[0]

    def largest(self):
        return max(self.choice)


class _Range(Section):
    """A [low, high] distribution; `default` must lie inside it."""

    def bounds(self) -> tuple[float, float]:
        raise NotImplementedError

    @model_validator(mode="after")
    def _ordered(self):
        low, high = self.bounds()
        if not low < high:
            raise ValueError(f"low {low!r} must be below high {high!r}; swap them or use a fixed value")
        if self.default is not None and not low <= self.default <= high:
            raise ValueError(f"default {self.default!r} lies outside [{low!r}, {high!r}]")
        return self

    def first(self):
        return self.default if self.default is not None else self.bounds()[0]

    def largest(self):
        return self.bounds()[1]


class Uniform(_Range, Generic[T]):
    """`{uniform: [low, high]}`: uniform float; both bounds of the knob's own type (base_lr's above 0)."""

    uniform: tuple[T, T] = Field(description="[low, high], both inclusive")
    default: T | None = Field(None, description="value for `train` and the first tune trial")

    def bounds(self):
        return self.uniform


class LogUniform(_Range, Generic[T]):
    """`{loguniform: [low, high]}`: log-uniform float, both bounds > 0."""

    loguniform: tuple[T, T] = Field(description="[low, high], both above 0; sampled uniformly in log space")
    default: T | None = Field(None, description="value for `train` and the first tune trial")

    def bounds(self):
        return self.loguniform


class RandInt(_Range, Generic[T]):
    """`{randint: [low, high]}`: uniform integer, both bounds inclusive and of the knob's own type (a per-GPU batch
    at least 1)."""

    randint: tuple[T, T] = Field(description="[low, high], integers, both inclusive")
    default: T | None = Field(None, description="value for `train` and the first tune trial")
    max: PosInt | Literal["probe"] | None = Field(
        None, description="per_gpu_batch_size only: larger samples run as max × more accumulation; probe → measure it"
    )

    def bounds(self):
        return self.randint

    @model_validator(mode="after")
    def _ordered(self):  # inclusive bounds: low == high is allowed
        low, high = self.randint
        if low > high:
            raise ValueError(f"low {low!r} must not exceed high {high!r}")
        if self.default is not None and not low <= self.default <= high:
            raise ValueError(f"default {self.default!r} lies outside [{low!r}, {high!r}]")
        return self


DISTRIBUTIONS = {"choice": Choice, "uniform": Uniform, "loguniform": LogUniform, "randint": RandInt}
Distribution = Union[Choice, Uniform, LogUniform, RandInt]


def _knob_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kinds = [k for k in DISTRIBUTIONS if k in value]
        return kinds[0] if len(kinds) == 1 else None
    for tag, cls in DISTRIBUTIONS.items():
        if isinstance(value, cls):
            return tag
    return "value"


def Knob(value_type, *distributions: str, whole=None):
    """A searchable knob: a fixed `value_type` or one of the named distributions, whose values (choices, bounds,
    default) are `value_type`s too, so that a range the trial cannot take (a base_lr from 0, a batch from 0) is
    refused where it is written. `whole`: randint's type, where `value_type` is not a whole number (warmup_epochs)."""
    members = [Annotated[value_type, Tag("value")]]
    for name in distributions:
        typed = whole if name == "randint" and whole is not None else value_type
        if name == "loguniform":
            typed = PosFloat  # a log needs both bounds above 0, whatever the knob takes
        members.append(Annotated[DISTRIBUTIONS[name][typed], Tag(name)])
    return Annotated[Union[tuple(members)], Discriminator(_knob_tag)]


def knob_first(knob) -> Any:
    """The value `train` uses: the knob's default, else the first choice / lower bound."""
    return knob.first() if isinstance(knob, BaseModel) else knob


def knob_largest(knob) -> Any:
    """The knob's largest value (largest choice, upper bound); a fixed knob's value."""
    return knob.largest() if isinstance(knob, BaseModel) else knob



def knob_extremes(knob) -> list:
    """Smallest and largest value of a searched knob ([] when it is not searched)."""
    if isinstance(knob, Choice):
        return sorted({min(knob.choice), max(knob.choice)})
    if isinstance(knob, _Range):
        return sorted(set(knob.bounds()))
    return []
