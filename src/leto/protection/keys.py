"""Store keys of the protection protocol (every key carries its generation)."""


def layout(gen: int) -> str:
    return f"prot/g{gen}/layout"


def ready(gen: int, node: int) -> str:
    return f"prot/g{gen}/ready/{node}"


def committed(gen: int, node: int) -> str:
    return f"prot/g{gen}/committed/{node}"


def keeper_pg(gen: int) -> str:
    return f"kpg/g{gen}/"


def drain(gen: int) -> str:
    return f"prot/g{gen}/drain"


def sent(gen: int, src: int, dst: int) -> str:
    return f"prot/g{gen}/sent/{src}/{dst}"


def report(gen: int, node: int) -> str:
    return f"prot/g{gen}/report/{node}"


def barrier_state(gen: int, node: int) -> str:
    """A draining keeper's barrier state: the next barrier and whether it entered it."""
    return f"prot/g{gen}/barrier/{node}"
