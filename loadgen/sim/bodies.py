"""A JSON body checked against a request model's fields, as FastAPI's pydantic validation refuses it: each refusal a
:class:`loadgen.sim.errors.BodyError` naming the field's place in the body."""

from __future__ import annotations

from typing import Any

from .errors import BodyError


def field(body: dict[str, Any], name: str, kinds: tuple[type, ...], required: bool = False, at: str = "") -> Any:
    """``body[name]`` if it has one of ``kinds`` (None when absent or null and not ``required``; a boolean is no
    number). ``at`` is where ``body`` sits in the request's body."""
    loc = f"{at}.{name}" if at else name
    value = body.get(name)
    if value is None:
        if required:
            raise BodyError(loc, "Field required")
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise BodyError(loc, f"Input should be a valid {kinds[0].__name__}")
    return value


def literal(value: Any, allowed: tuple[Any, ...], loc: str) -> None:
    """``value`` is one of ``allowed`` (a None among them lets the field be absent)."""
    if value not in allowed:
        names = [repr(a) for a in allowed if a is not None]
        raise BodyError(loc, f"Input should be {', '.join(names[:-1])} or {names[-1]}")
