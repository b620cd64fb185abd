"""``python -m lightning_perf.cli`` is the ``lightning-perf`` command too."""

from lightning_perf.cli import main

if __name__ == "__main__":
    main()
