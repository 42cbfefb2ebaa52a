"""argparse types shared by the eval scripts' command lines."""
import argparse


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts and sizes: an int of at least 1, else a parse error
    ("argument --X: must be >= 1, got 0"); a non-integer reads as argparse's "invalid
    positive_int value"."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def power_of_two(text: str) -> int:
    """argparse ``type=`` for warp counts and block sizes: a positive power of two, else a
    parse error ("argument --X: must be a power of two, got 3")."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value
