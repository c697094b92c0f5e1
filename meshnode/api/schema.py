"""What every API surface's request models share: strict JSON types, and validation errors as one
OpenAI-style 400 naming the field (``messages[0].content``) and what it takes."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from meshnode.errors import ApiError

Number = Annotated[float, Field(allow_inf_nan=False)]  # finite, not a boolean
JsonObject = dict[str, Any]
OUR_CODES = ("invalid_type", "invalid_value")  # raised by our own checks


class Strict(BaseModel):
    """JSON types as they are (no "5" for 5, no 1.0 for an integer), and no undeclared field."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def one_of(message: str) -> WrapValidator:
    """A union's errors (one per member) read as one: the field and what it takes."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", message) from None

    return WrapValidator(check)


def optional(fields: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """(name, type) pairs as fields for ``pydantic.create_model``, each optional (null = absent)."""
    return {name: (kind | None if kind is not None else None, None) for name, kind in fields}


def validate(model: type[BaseModel], body: Any, context: dict[str, Any] | None = None) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise api_error(exc) from None


# pydantic's error types that say the value is of the right type but not allowed
_VALUE_ERRORS = {
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "too_short",
    "too_long",
    "string_too_short",
    "string_too_long",
    "finite_number",
    "literal_error",
    "none_required",
}
_PLAIN_WORDS = {
    "model_type": "should be an object",
    "dict_type": "should be an object",
    "too_short": "should not be empty",
    "string_too_short": "should not be empty",
}


def api_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 that names the field."""
    errors = exc.errors(include_url=False)
    first, more = errors[0], len(errors) - 1
    kind, loc, msg = first["type"], first["loc"], first["msg"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if kind == "extra_forbidden":
        code, message = "unsupported_parameter", f"unsupported parameter '{param}': this server does not know it"
    elif kind == "missing":
        code, message = "missing_required_parameter", f"'{param}' is required"
    else:
        code = kind if kind in OUR_CODES else "invalid_value" if kind in _VALUE_ERRORS else "invalid_type"
        if kind in _PLAIN_WORDS:
            text = _PLAIN_WORDS[kind]
        elif msg.startswith("Input "):  # "Input should be a valid integer"
            text = msg[len("Input ") :]
        else:
            text = msg if kind in OUR_CODES else f"is invalid: {msg}"
        if kind in ("literal_error", "none_required"):  # pydantic says None, False; JSON says null, false
            text = text.replace("None", "null").replace("False", "false").replace("True", "true")
        message = f"'{param}' {text}" if param else f"the request body: {text}"
        value = first.get("input")
        if isinstance(value, (str, int, float, bool)):
            message += f", got {json.dumps(value)[:80]}"
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ApiError(400, message, param=param, code=code)
