"""`register_classes` and `subclass_of`: the implementation shared by both register functions."""

from __future__ import annotations

import pytest

from lit_losses.controller.registration import register_classes, subclass_of
from lit_losses.registry import Registry


class Base:
    pass


class A(Base):
    pass


class B(Base):
    pass


def registry() -> Registry[type]:
    return Registry("thing", adapt=subclass_of(Base, "thing"))


def test_positional_lists_and_named_classes():
    things = registry()
    register_classes(things, (A, [B], (A,)), {"Other": B})
    assert things.names() == ["A", "B", "Other"]
    assert things["Other"] is B


def test_re_registering_the_same_class_is_allowed():
    things = registry()
    register_classes(things, (A,), {})
    register_classes(things, (A,), {})
    assert things.names() == ["A"]


@pytest.mark.parametrize("wrong", [object, A(), None, 3])
def test_anything_but_a_subclass_is_a_type_error(wrong):
    with pytest.raises(TypeError, match="must be a Base subclass"):
        register_classes(registry(), (wrong,), {})


def test_the_message_uses_the_right_article():
    class Item:
        pass

    with pytest.raises(TypeError, match="'x' must be an Item subclass"):
        subclass_of(Item, "item")("x", int)
