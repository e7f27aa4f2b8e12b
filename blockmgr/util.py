"""Small arithmetic shared by the paging core and its users."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0`` (e.g. the blocks that hold ``a`` tokens)."""
    return -(-a // b)
