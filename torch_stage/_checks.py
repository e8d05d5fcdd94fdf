"""Argument checks shared by the public constructors."""

import numbers
import operator

#: The largest int the C++ side takes (int64_t): a larger Python int would
#: fail to convert there with an error that names neither it nor its argument.
INT64_MAX = 2**63 - 1

#: The most threads a Linux process can have (PID_MAX_LIMIT on 64-bit
#: kernels): a thread count above it is a mistake, never a wish.
MAX_THREADS = 2**22

#: The most producer threads one stage may have (stage.cpp's
#: kMaxStageThreads). Each holds an item it is making and a stack: far above
#: the cores of any machine or the requests a source keeps in flight, and a
#: larger number is a typo (2**16 started some 32k threads, seconds and GBs,
#: before the kernel refused the rest).
MAX_STAGE_THREADS = 1024

#: A float wait (seconds, possibly inf) longer than this (about 31.7 years)
#: is waited as this long; the C++ side waits longer ones forever.
MAX_WAIT_MS = 10**12


def is_int(value) -> bool:
    """Any integral type (numpy's too, as Python's own int checks take it);
    not bools, which are ints to Python but never a count, a size or a rank."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int, rule: str, maximum: int = INT64_MAX) -> int:
    """``value`` as an int in ``[minimum, maximum]``; TypeError or ValueError
    naming the argument, the value and ``rule`` otherwise (bools are not ints
    here). ``maximum`` defaults to the C++ side's int64 range."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be {rule}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be {rule} and at most {maximum}, got {value}")
    return value
