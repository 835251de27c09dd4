"""A generation's groups leave together, with the groups its recovery built beside them."""

from __future__ import annotations

from leto.runtime.mesh import MeshComms


class _Group:
    """Stands in for a `Comm`: records how it was left."""

    def __init__(self) -> None:
        self.pg: object | None = object()
        self.left: list[bool] = []

    def close(self, abandon: bool = False) -> None:
        self.left.append(abandon)
        self.pg = None


def test_a_recoverys_side_groups_are_parked_with_the_generations_groups() -> None:
    """The tier-1 decode's node groups are not dropped when the decode ends (destroying a gloo
    group blocks, in the recovery's path): they are parked when the generation's groups are."""
    world, tp, dp, decode_n0, decode_n1 = (_Group() for _ in range(5))
    MeshComms(world=world, tp=tp, dp=dp, side=[decode_n0, decode_n1]).close(abandon=True)
    for group in (world, tp, dp, decode_n0, decode_n1):
        assert group.left == [True]


def test_a_group_left_already_is_not_left_twice() -> None:
    world, side = _Group(), _Group()
    side.close(abandon=True)
    MeshComms(world=world, tp=None, dp=world, side=[side]).close(abandon=True)
    assert side.left == [True]
    assert world.left == [True]
