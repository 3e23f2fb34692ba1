"""Immutable records: tuples with named fields, cheap to define.

They replace collections.namedtuple on the hook's path: namedtuple imports collections and
compiles a constructor for every class with exec, together about 2 ms of every GPU container
start for gpuhook's thirty-odd record types (measured by benchmarks/). A record behaves like
the namedtuple it replaces: positional or keyword construction with defaults, attribute
access, tuple equality and hashing, ``_fields``, ``_replace()`` and ``_asdict()``; subclass
it with ``__slots__ = ()`` to add properties and methods.
"""

import sys
from _operator import itemgetter  # the C half of operator: what namedtuple uses too


def record(typename: str, field_names: str, defaults: tuple = ()) -> type:
    """A tuple subclass named `typename` with the space-separated `field_names`; the last
    len(`defaults`) fields default to those values."""
    fields = tuple(field_names.split())
    count = len(fields)
    first_default = count - len(defaults)
    default_of = dict(zip(fields[first_default:], defaults))

    def __new__(cls, *args, **kwargs):
        if len(args) > count:
            raise TypeError(f"{typename}() takes {count} arguments, {len(args)} given")
        values = list(args)
        for name in fields[len(args):]:
            if name in kwargs:
                values.append(kwargs.pop(name))
            elif name in default_of:
                values.append(default_of[name])
            else:
                raise TypeError(f"{typename}() missing argument {name!r}")
        if kwargs:
            raise TypeError(f"{typename}() got unexpected or repeated arguments {sorted(kwargs)}")
        return tuple.__new__(cls, values)

    def _replace(self, **changes):
        values = [changes.pop(name, value) for name, value in zip(fields, self)]
        if changes:
            raise TypeError(f"{typename} has no fields {sorted(changes)}")
        return tuple.__new__(type(self), values)

    def _asdict(self) -> dict:
        return dict(zip(fields, self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(f"{n}={v!r}" for n, v in zip(fields, self)) + ")"

    def __getnewargs__(self):
        return tuple(self)

    namespace = {
        "__slots__": (),
        "_fields": fields,
        "_field_defaults": default_of,
        "__new__": __new__,
        "_replace": _replace,
        "_asdict": _asdict,
        "__repr__": __repr__,
        "__getnewargs__": __getnewargs__,
        "__doc__": f"{typename}({', '.join(fields)})",
        # The defining module, as namedtuple does, so pickle and repr name the right place.
        "__module__": sys._getframe(1).f_globals.get("__name__", __name__),
    }
    for index, name in enumerate(fields):
        namespace[name] = property(itemgetter(index), doc=f"field {index}: {name}")
    return type(typename, (tuple,), namespace)
