"""The four registries (formats, layouts, targets, algorithms) share one small shape, moequant.registry.Registry:
entries by name in registration order, `add`, and `find` refusing in the registry's own sentence."""

from __future__ import annotations

import pytest

from moequant.algorithms.registry import ALGORITHMS, algorithm
from moequant.errors import UserError
from moequant.formats import REGISTRY, register
from moequant.layouts import LAYOUTS, RECIPE_LAYOUTS, layout_for
from moequant.registry import Registry
from moequant.targets import TARGETS, get_target


def test_every_registry_is_a_registry():
    assert all(isinstance(r, Registry) for r in (REGISTRY, LAYOUTS, RECIPE_LAYOUTS, TARGETS, ALGORITHMS))


def test_an_unknown_name_is_refused_in_its_registry_s_sentence_listing_what_is_accepted():
    with pytest.raises(UserError, match=r"^target 'nope' is not a target; accepted: vllm, sglang, transformers"):
        get_target("nope")
    with pytest.raises(UserError, match=r"^export layout 'nope' is not supported; accepted: compressed-tensors, "):
        layout_for("nope")
    with pytest.raises(ValueError, match=r"^'nope' is not an algorithm; accepted: rtn, gptq, awq, imatrix"):
        algorithm("nope")


def test_a_format_name_registered_twice_is_a_programming_error():
    with pytest.raises(ValueError, match="format name 'bf16' is registered twice"):
        register(REGISTRY["bf16"])


def test_add_and_find_on_a_registry_of_its_own():
    fruit = Registry("fruit", "{name!r} is no fruit; accepted: {accepted}.")
    assert fruit.add("yellow", "banana", "plantain") == "yellow"
    assert list(fruit) == ["banana", "plantain"] and fruit.find("plantain") == "yellow"
    fruit.add("green", "banana")  # a later entry of a name replaces the earlier one
    assert fruit.find("banana") == "green"
    with pytest.raises(UserError, match=r"^'kiwi' is no fruit; accepted: banana, plantain\.$"):
        fruit.find("kiwi")
    with pytest.raises(ValueError, match="fruit name 'banana' is registered twice"):
        fruit.add("red", "banana", unique=True)
