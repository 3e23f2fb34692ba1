"""gpuhook.record: what the replaced namedtuples did, the records do."""

import pickle

import pytest

from gpuhook.record import record

Point = record("Point", "x y z", defaults=(0,))


class Labelled(record("Labelled", "name value")):
    __slots__ = ()

    @property
    def shout(self) -> str:
        return self.name.upper()


def test_construction_access_and_defaults():
    p = Point(1, 2)
    assert (p.x, p.y, p.z) == (1, 2, 0) and p == (1, 2, 0) and isinstance(p, tuple)
    assert Point(x=1, y=2, z=3) == Point(1, 2, 3) == Point(1, z=3, y=2)
    assert Point._fields == ("x", "y", "z") and Point._field_defaults == {"z": 0}


@pytest.mark.parametrize("make, message", [
    (lambda: Point(1), "missing argument 'y'"),
    (lambda: Point(1, 2, 3, 4), "takes 3 arguments"),
    (lambda: Point(1, 2, w=5), "unexpected or repeated"),
    (lambda: Point(1, 2, x=5), "unexpected or repeated"),
])
def test_bad_construction(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_replace_asdict_repr_hash_and_pickle():
    p = Point(1, 2, 3)
    assert p._replace(y=9) == Point(1, 9, 3) and type(p._replace(y=9)) is Point
    with pytest.raises(TypeError, match="no fields"):
        p._replace(w=1)
    assert p._asdict() == {"x": 1, "y": 2, "z": 3}
    assert repr(p) == "Point(x=1, y=2, z=3)"
    assert hash(p) == hash((1, 2, 3)) and {p: 1}[Point(1, 2, 3)] == 1
    assert pickle.loads(pickle.dumps(p)) == p


def test_subclass_with_behaviour_and_immutability():
    item = Labelled("gpu", 3)
    assert item.shout == "GPU" and repr(item) == "Labelled(name='gpu', value=3)"
    with pytest.raises(AttributeError):
        item.name = "x"
    with pytest.raises(AttributeError):
        item.other = 1  # __slots__ = (): no instance dict
