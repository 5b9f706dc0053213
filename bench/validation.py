"""Argument validation alone: a realistic schema (nested objects, 20 fields), valid and invalid arguments."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from toolmesh.core.schemas import compile_schema, violations
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.invoker import check_arguments

_STRING = {"type": "string", "minLength": 1, "maxLength": 200}

# 20 fields: 4 at the top level, 5 in customer, 3 in items[], 5 in shipping (4 in its address), 3 in payment.
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["orderId", "customer", "items", "shipping"],
    "properties": {
        "orderId": {"type": "string", "pattern": "^ord_[a-z0-9]{8}$"},
        "customer": {
            "type": "object",
            "additionalProperties": False,
            "required": ["id", "email"],
            "properties": {
                "id": {"type": "string", "pattern": "^cus_[a-z0-9]+$"},
                "email": {"type": "string", "format": "email", "maxLength": 254},
                "name": _STRING,
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "phone": {"type": "string", "pattern": "^\\+[0-9]{6,15}$"},
            },
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 50,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["sku", "quantity"],
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                    "unitPrice": {"type": "number", "exclusiveMinimum": 0},
                },
            },
        },
        "shipping": {
            "type": "object",
            "required": ["address", "method"],
            "properties": {
                "address": {
                    "type": "object",
                    "required": ["line1", "city", "country"],
                    "properties": {
                        "line1": _STRING,
                        "city": _STRING,
                        "postalCode": {"type": "string", "pattern": "^[A-Z0-9 -]{3,10}$"},
                        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                    },
                },
                "method": {"enum": ["standard", "express", "pickup"]},
            },
        },
        "payment": {
            "type": "object",
            "required": ["method"],
            "properties": {
                "method": {"enum": ["card", "invoice", "wallet"]},
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "amount": {"type": "number", "minimum": 0},
            },
        },
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "giftMessage": {"type": ["string", "null"], "maxLength": 500},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 10},
    },
}

VALID: dict[str, Any] = {
    "orderId": "ord_8k2m4x9q",
    "customer": {
        "id": "cus_42",
        "email": "ada@example.com",
        "name": "Ada Lovelace",
        "tier": "pro",
        "phone": "+442071234567",
    },
    "items": [
        {"sku": "ABC-1234", "quantity": 2, "unitPrice": 19.99},
        {"sku": "XYZ-0001", "quantity": 1, "unitPrice": 5.5},
        {"sku": "LMN-7777", "quantity": 10},
    ],
    "shipping": {
        "address": {"line1": "12 Analytical St", "city": "London", "postalCode": "N1 9GU", "country": "GB"},
        "method": "express",
    },
    "payment": {"method": "card", "currency": "GBP", "amount": 100.48},
    "priority": 3,
    "giftMessage": None,
    "tags": ["b2c", "priority"],
}

# Five violations: a bad pattern, a missing required field, a wrong type, an
# unknown enum value and an unexpected property.
INVALID: dict[str, Any] = {
    **VALID,
    "orderId": "order-1",
    "customer": {"id": "cus_42", "name": "Ada Lovelace"},
    "items": [{"sku": "ABC-1234", "quantity": "two"}],
    "shipping": {**VALID["shipping"], "method": "teleport"},
    "coupon": "FREE",
}

SCHEMA_TEXT = json.dumps(SCHEMA)
TOOL = ToolSpec("place_order", "Place an order", SCHEMA_TEXT)


def count_fields(schema: dict[str, Any]) -> int:
    """Leaf properties (those that are not objects themselves), anywhere in the schema."""
    total = 0
    for sub in schema.get("properties", {}).values():
        nested = sub.get("items", sub) if sub.get("type") == "array" else sub
        if "properties" in nested:
            total += count_fields(nested)
        else:
            total += 1
    return total


def _rate(fn: Callable[[], object], iterations: int) -> dict[str, float]:
    fn()  # warm: compiles and caches
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, time.perf_counter() - started)
    return {"calls_per_s": iterations / best, "us_per_call": best / iterations * 1e6}


def run(iterations: int) -> dict[str, Any]:
    valid_json, invalid_json = json.dumps(VALID), json.dumps(INVALID)

    def validator(instance: Any) -> Callable[[], object]:
        def once() -> object:
            compiled = compile_schema(SCHEMA_TEXT, tool=TOOL.name, which="inputSchema", require_object=True)
            return violations(compiled, instance)

        return once

    compiled = compile_schema(SCHEMA_TEXT, tool=TOOL.name, which="inputSchema", require_object=True)
    found = violations(compiled, INVALID)
    if violations(compiled, VALID) or not found:
        raise RuntimeError("the validation fixtures do not behave as intended")
    if check_arguments(TOOL, valid_json) is not None or check_arguments(TOOL, invalid_json) is None:
        raise RuntimeError("check_arguments does not behave as intended")
    return {
        "fields": count_fields(SCHEMA),
        "violations_in_invalid": len(found),
        "iterations": iterations,
        "rows": {
            "violations() valid": _rate(validator(VALID), iterations),
            "violations() invalid": _rate(validator(INVALID), iterations),
            "check_arguments() valid": _rate(lambda: check_arguments(TOOL, valid_json), iterations),
            "check_arguments() invalid": _rate(lambda: check_arguments(TOOL, invalid_json), iterations),
            "(reference) is_valid() valid": _rate(lambda: compiled.is_valid(VALID), iterations),
        },
    }
