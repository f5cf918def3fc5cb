import pytest

from lit_losses.errors import ConfigError
from lit_losses.registry import Registry, closest


class Base:
    pass


class Child(Base):
    pass


def only_base_subclasses(name, obj):
    if not (isinstance(obj, type) and issubclass(obj, Base)):
        raise TypeError(f"{name!r} must be a Base subclass, got {obj!r}")
    return obj


def test_register_get_and_list():
    registry = Registry("widget", adapt=only_base_subclasses)
    assert registry.register("child", Child) is Child
    assert registry.get("child", "cfg.widget") is Child
    assert "child" in registry and list(registry) == ["child"] and len(registry) == 1
    assert registry.find(Child) is Child and registry.find(Base) is None


def test_typo_names_where_and_the_closest_name():
    registry = Registry("widget")
    registry.register("entropy", 1)
    with pytest.raises(ConfigError, match=r"^cfg\.w: unknown widget 'entrpy'; did you mean 'entropy'\?"):
        registry.get("entrpy", "cfg.w")
    with pytest.raises(ConfigError, match=r"unknown widget 'zzz' \(registered: \['entropy'\]\)"):
        registry.get("zzz", "cfg.w")


def test_import_path_is_adapted_and_checked():
    registry = Registry("widget", adapt=only_base_subclasses)
    assert registry.get(f"{__name__}.Child", "cfg") is Child
    with pytest.raises(ConfigError, match=r"cfg: .*must be a Base subclass"):
        registry.get(f"{__name__}.closest", "cfg")
    with pytest.raises(ConfigError, match=r"cfg: cannot import widget 'no_such_module\.Thing'"):
        registry.get("no_such_module.Thing", "cfg")


def test_reregistering_the_same_definition_replaces_another_raises():
    registry = Registry("widget")

    def make():
        def fn():
            return 1

        return fn

    registry.register("fn", make())
    registry.register("fn", make())  # same qualified name: a re-run notebook cell
    with pytest.raises(ValueError, match="already registered"):
        registry.register("fn", closest)
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("", 1)


def test_closest():
    assert closest("cosin", ["cosine", "linear"]) == "; did you mean 'cosine'?"
    assert closest("xyz", ["cosine"]) == ""


def test_unregister_scoped_items_values():
    registry = Registry("widget")
    registry.register("a", 1)
    with registry.scoped():
        registry.register("b", 2)
        assert registry.items() == [("a", 1), ("b", 2)] and registry.values() == [1, 2]
    assert registry.names() == ["a"]
    assert registry.unregister("a") == 1 and len(registry) == 0
    with pytest.raises(KeyError, match="no widget named 'a'"):
        registry.unregister("a")
