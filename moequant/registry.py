"""The one shape of moequant's four registries (formats, layouts, targets, algorithms): entries by name in the
order they were registered (messages list them so), `add` to register one under its names, `find` to look
one up or refuse in the registry's own sentence. It is a plain dict underneath: callers iterate it, test
`in`, read and `pop` it as they would a dict."""

from __future__ import annotations

from moequant.errors import UserError


class Registry(dict):
    """kind: what an entry is ("format", "target", ...); refusal: the sentence for a name nobody registered,
    with {name} and {accepted} (the registered names, in order); error: the exception it raises."""

    def __init__(self, kind: str, refusal: str = "", error: type[Exception] = UserError):
        super().__init__()
        self.kind, self.refusal, self.error = kind, refusal, error

    def add(self, entry, *names: str, unique: bool = False):
        """Register `entry` under each of `names` (a later entry of a name replaces the earlier one, unless
        `unique`: then a second entry of a name is a programming error). Returns `entry`."""
        for name in names:
            if unique and name in self:
                raise ValueError(f"{self.kind} name {name!r} is registered twice")
            self[name] = entry
        return entry

    def find(self, name):
        """The entry registered as `name`, or the registry's refusal."""
        try:
            return self[name]
        except (KeyError, TypeError):
            raise self.error(self.refusal.format(name=name, accepted=", ".join(self))) from None
