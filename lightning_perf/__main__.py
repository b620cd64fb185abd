"""``python -m lightning_perf`` is the ``lightning-perf`` command."""

from lightning_perf.cli import main

if __name__ == "__main__":
    main()
