"""The name index: which object holds which CRI name, in memory.

Tiny and boring on purpose. It knows nothing of phases, deadlines or persistence: the
coordinator decides when a name is taken or freed and writes the database through its hooks
in the same step. Keeping the index apart makes "one name, one object" a property of a
dozen lines that can be checked by reading them.
"""

from __future__ import annotations

from cri_shim.errors import AlreadyExists


class NameTaken(AlreadyExists):
    """The name is held by another object; `holder` is that object's ID."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(f"name {name!r} is reserved for {holder}")
        self.name = name
        self.holder = holder


class NameRegistrar:
    """A two-way index between names and the IDs of the objects that hold them."""

    def __init__(self) -> None:
        self._by_name: dict[str, str] = {}
        self._by_id: dict[str, str] = {}

    def reserve(self, name: str, object_id: str) -> None:
        """Give `name` to `object_id`; raise NameTaken if another object holds it.

        Reserving the same pair again is a no-op, so that replaying a restore is harmless.
        One object holds at most one name: an ID that already holds another name is a bug
        in the caller, reported as ValueError.
        """
        if not name or not object_id:
            raise ValueError("name and object ID must not be empty")
        holder = self._by_name.get(name)
        if holder is not None:
            if holder == object_id:
                return
            raise NameTaken(name, holder)
        held = self._by_id.get(object_id)
        if held is not None:
            raise ValueError(f"object {object_id} already holds name {held!r}")
        self._by_name[name] = object_id
        self._by_id[object_id] = name

    def get(self, name: str) -> str | None:
        """The ID of the object holding `name`, if any."""
        return self._by_name.get(name)

    def name_of(self, object_id: str) -> str | None:
        """The name held by `object_id`, if any."""
        return self._by_id.get(object_id)

    def release(self, name: str) -> None:
        """Free `name`. Releasing a free name is a no-op: cleanup paths may overlap."""
        object_id = self._by_name.pop(name, None)
        if object_id is not None:
            del self._by_id[object_id]

    def names(self) -> list[str]:
        """A snapshot of the held names, oldest reservation first."""
        return list(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)
