"""servegate command line (placeholder until the gate lands)."""


def main(argv=None) -> int:
    return 0
