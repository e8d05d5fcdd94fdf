"""Argument checks shared by the public constructors."""


def check_int(name: str, value, minimum: int, rule: str) -> int:
    """``value`` as an int >= ``minimum``; TypeError or ValueError naming the
    argument, the value and ``rule`` otherwise (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value
